"""A static key/value cache for captured decoding steps: fixed buffers, sized by buckets of the real length.

A CUDA graph replays kernels on the memory they were captured with, so every tensor a captured decoding
step reads or writes has to stay at one address, with one shape, from capture to the last replay. This is
that memory for :mod:`~spader_pipeline.modeling.graph_decode`: per decoder layer one key and one value
buffer ``[rows, H_kv, length, D]``, the captured boundary states, the mask of attendable positions, and
each row's decoding state (its last token, position, budget, whether it ended, its sampled tokens and
their log-probabilities, its uniform numbers).

Sizes are buckets, so a few captured graphs serve every batch:

* the allocation holds :func:`row_bucket` rows of the largest batch seen and :func:`allocation_length`
  positions of the longest context plus turn seen (a geometric series, so a rollout whose contexts grow
  turn by turn reallocates a few times, not every turn); it never shrinks, and never takes the
  trajectory's whole budget (as transformers' ``StaticCache`` sized by ``max_cache_len`` does);
* a step attends over a view of it: :func:`row_bucket` rows of the rows still decoding (finished rows are
  masked, and moved behind the going ones when the going ones fit a smaller bucket,
  :meth:`StaticKVCache.compact`) and :func:`length_bucket` positions of the real length so far
  (:data:`LENGTH_QUANTUM` at a time, growing to the next bucket as the turn goes on; with the Triton
  attention, which reads no position past the cursor whatever the view, the whole allocation). A graph is
  captured once per view's shape while the allocation lasts.

The switches: :data:`STATIC_DECODE` (``SPADER_STATIC_DECODE``: ``auto``, the static step on CUDA; ``on``,
on any device, the CPU running the same step without graphs, as the tests do; ``off``),
:data:`CUDA_GRAPHS` (``SPADER_CUDA_GRAPHS=off``: the same static step, launched op by op) and
:data:`DECODE_ATTENTION` (``SPADER_DECODE_ATTENTION``: ``sdpa``, or ``triton`` for the step's attention as
one Triton kernel, :mod:`~spader_pipeline.modeling.triton_attention`) and :data:`DECODE_KERNELS`
(``SPADER_DECODE_KERNELS``: ``aten``, or ``triton`` for the work between the step's products as fused Triton
kernels, :mod:`~spader_pipeline.modeling.triton_step`).
"""

from __future__ import annotations

import os

import torch

from spader_pipeline.modeling import triton_attention

__all__ = ["CUDA_GRAPHS", "DECODE_ATTENTION", "DECODE_KERNELS", "LENGTH_QUANTUM", "ROW_BUCKETS", "STATIC_DECODE", "SYNC_EVERY",
           "StaticKVCache", "allocation_length", "length_bucket", "row_bucket", "static_attention_name",
           "static_decode_selected", "static_kernels_name", "static_step_name"]

STATIC_DECODE_ENV = "SPADER_STATIC_DECODE"
CUDA_GRAPHS_ENV = "SPADER_CUDA_GRAPHS"
#: ``auto``: decode with the static step where the model is on CUDA; ``on``: on any device (the CPU runs the
#: step eagerly: the tests' way to run its logic); ``off``: never
STATIC_DECODE = os.environ.get(STATIC_DECODE_ENV, "auto").strip().lower()
#: capture the static step in CUDA graphs on CUDA (off: the same step, launched op by op)
CUDA_GRAPHS = os.environ.get(CUDA_GRAPHS_ENV, "on").strip().lower() != "off"
DECODE_ATTENTION_ENV = "SPADER_DECODE_ATTENTION"
#: the static step's attention where it is SDPA's (CUDA; a CPU decoding a model in its own fp32 or bf16):
#: ``sdpa`` (over the length bucket, an additive mask) or ``triton`` (one kernel that reads the grouped heads
#: once and no position past the step's last; where Triton runs, else ``sdpa``)
DECODE_ATTENTION = os.environ.get(DECODE_ATTENTION_ENV, "sdpa").strip().lower()
DECODE_KERNELS_ENV = "SPADER_DECODE_KERNELS"
#: the static step's work between its products: ``aten`` (torch's operations, some twenty kernels a block) or
#: ``triton`` (four fused kernels a block, :mod:`~spader_pipeline.modeling.triton_step`; where Triton runs and
#: the step's residual stream is fp32, else ``aten``)
DECODE_KERNELS = os.environ.get(DECODE_KERNELS_ENV, "aten").strip().lower()
#: decoding steps between two reads of which rows ended (the only reads from the device while decoding)
SYNC_EVERY = 8
#: rows of a step: its graph's batch sizes (vLLM captures its decoding graphs per batch size the same way)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
#: positions a step attends over grow in steps of this many
LENGTH_QUANTUM = 256


def static_decode_selected(device: torch.device | str) -> bool:
    """Whether :data:`STATIC_DECODE` selects the static step for a model on ``device``."""
    if STATIC_DECODE not in ("auto", "on", "off"):
        raise ValueError(f"{STATIC_DECODE_ENV}={STATIC_DECODE!r}: use auto, on or off")
    return STATIC_DECODE == "on" or (STATIC_DECODE == "auto" and torch.device(device).type == "cuda")


def static_step_name(device: torch.device | str) -> str | None:
    """How a supported model's decoding steps run on ``device`` under the switches: ``graph`` (captured in
    CUDA graphs), ``static`` (the static step launched op by op), or ``None`` (not the static step)."""
    if not static_decode_selected(device):
        return None
    return "graph" if CUDA_GRAPHS and torch.device(device).type == "cuda" else "static"


def static_attention_name() -> str:
    """The static step's SDPA-kind attention under :data:`DECODE_ATTENTION`: ``triton`` where chosen and Triton
    runs here (:func:`~spader_pipeline.modeling.triton_attention.available`), else ``sdpa``."""
    if DECODE_ATTENTION not in ("sdpa", "triton"):
        raise ValueError(f"{DECODE_ATTENTION_ENV}={DECODE_ATTENTION!r}: use sdpa or triton")
    return "triton" if DECODE_ATTENTION == "triton" and triton_attention.available() else "sdpa"


def static_kernels_name() -> str:
    """The static step's kernels between its products under :data:`DECODE_KERNELS`: ``triton`` where chosen and
    Triton runs here, else ``aten``."""
    if DECODE_KERNELS not in ("aten", "triton"):
        raise ValueError(f"{DECODE_KERNELS_ENV}={DECODE_KERNELS!r}: use aten or triton")
    return "triton" if DECODE_KERNELS == "triton" and triton_attention.available() else "aten"


def row_bucket(rows: int) -> int:
    """The smallest of :data:`ROW_BUCKETS` that holds ``rows``; past the largest, a multiple of it."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    largest = ROW_BUCKETS[-1]
    return -(-rows // largest) * largest


def length_bucket(length: int, limit: int) -> int:
    """Positions a step attends over when ``length`` of them are real: ``length`` rounded up to
    :data:`LENGTH_QUANTUM`, at most ``limit`` (the allocation's, which holds ``length``)."""
    return min(-(-length // LENGTH_QUANTUM) * LENGTH_QUANTUM, limit)


def allocation_length(length: int) -> int:
    """Positions to allocate for ``length``: the smallest of 256, 512, 768, 1024, then half again and a third
    again in turn (1536, 2048, 3072, 4096, …; multiples of :data:`LENGTH_QUANTUM`) that holds it."""
    size = LENGTH_QUANTUM
    while size < length:
        if size < 4 * LENGTH_QUANTUM:
            size += LENGTH_QUANTUM
        else:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


class StaticKVCache:
    """The buffers of captured decoding steps (module docstring), allocated once at ``rows`` x ``length``
    positions x ``steps`` sampled tokens per row.

    Per layer ``keys[l]``/``values[l]`` ``[rows, H_kv, length, D]`` (``kv_dtype``), zeros when allocated;
    ``states`` ``[rows, 1, length, H]`` (``states_dtype``) where ``states_width`` is given. Row state:
    ``valid`` bool ``[rows, length]`` (attendable positions), ``first`` long ``[rows]`` (each row's first
    attendable position: its left padding ends there), ``token``/``position`` long ``[rows]`` (the
    token each row feeds next and its logical position), ``cursor`` long ``[1]`` (the physical position
    the next step writes), ``step`` long ``[1]`` (the index of the token the next sampling draws),
    ``budget``/``count`` long ``[rows]`` (most tokens; tokens sampled before the row ended), ``done`` bool
    ``[rows]``, ``tokens`` long / ``log_probs`` fp32 ``[rows, steps]``, ``uniforms`` fp32 ``[steps, rows]``.
    """

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, rows: int, length: int, steps: int,
                 kv_dtype: torch.dtype, device: torch.device, states_width: int | None = None,
                 states_dtype: torch.dtype = torch.float32, allocate_layers: bool = True) -> None:
        self.rows, self.length, self.steps, self.kv_dtype = rows, length, steps, kv_dtype
        self.device, self.states_width = torch.device(device), states_width
        self._shape = (rows, kv_heads, length, head_dim)
        self.keys: list[torch.Tensor] = [None] * layers
        self.values: list[torch.Tensor] = [None] * layers
        for layer in range(layers) if allocate_layers else ():
            self.allocate_layer(layer)
        self.states = (torch.zeros((rows, 1, length, states_width), dtype=states_dtype, device=device)
                       if states_width is not None else None)

        def longs(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=device)

        self.valid = torch.zeros((rows, length), dtype=torch.bool, device=device)
        self.token, self.position, self.budget, self.count = longs(rows), longs(rows), longs(rows), longs(rows)
        self.first = longs(rows)
        self.cursor, self.step = longs(1), longs(1)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.tokens = longs(rows, steps)
        self.log_probs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        self.uniforms = torch.zeros((steps, rows), dtype=torch.float32, device=device)

    def allocate_layer(self, layer: int) -> None:
        """Layer ``layer``'s key and value buffers, zeros (``allocate_layers=False`` leaves them to this, so
        that a cache moving from a smaller allocation frees its old layers one by one as the new come)."""
        self.keys[layer] = torch.zeros(self._shape, dtype=self.kv_dtype, device=self.device)
        self.values[layer] = torch.zeros(self._shape, dtype=self.kv_dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the key/value and states buffers."""
        buffers = [*self.keys, *self.values, *([self.states] if self.states is not None else [])]
        return sum(buffer.numel() * buffer.element_size() for buffer in buffers)

    def pointers(self) -> set[int]:
        """The data pointers of the key/value and states buffers (a cache holding its contents in them
        points at one: :meth:`~spader_pipeline.modeling.kv_cache.GrowingKVCache.own_storage`)."""
        return {buffer.data_ptr() for buffer in [*self.keys, *self.values, *([self.states] if self.states is not None else [])]}

    def fits(self, *, rows: int, length: int, steps: int, states_width: int | None) -> bool:
        """Whether these buffers hold a call of ``rows`` x ``length`` positions x ``steps`` tokens (and its
        captured states of ``states_width``, where asked)."""
        return (rows <= self.rows and length <= self.length and steps <= self.steps
                and (states_width is None or states_width == self.states_width))

    def begin(self, *, rows: int, width: int, mask: torch.Tensor, positions: torch.Tensor, budgets: list[int],
              uniforms: torch.Tensor | None) -> None:
        """The row state for a call of ``rows`` rows whose caches hold ``width`` positions: ``mask`` ``[rows,
        width]`` (1: real), ``positions`` long ``[rows]`` (the logical position of each row's first fed
        token), ``budgets`` (most tokens per row), ``uniforms`` fp32 ``[steps, rows]`` (each step's uniform
        number per row; ``None``: greedy). The rows past ``rows`` start as ended."""
        self.valid.zero_()
        self.valid[:rows, :width] = mask.to(device=self.device, dtype=torch.bool)
        self.first.zero_()
        self.first[:rows] = self.valid[:rows, :width].to(torch.uint8).argmax(dim=1)  # argmax: the first True
        self.token.zero_()
        self.position.zero_()
        self.position[:rows] = positions.to(self.device)
        self.cursor.fill_(width)
        self.step.zero_()
        self.budget.zero_()
        self.budget[:rows] = _to_device(torch.tensor(budgets, dtype=torch.long), self.device)
        self.done.fill_(True)
        self.done[:rows] = False
        self.count.zero_()
        if uniforms is not None:
            self.uniforms[: uniforms.shape[0], :rows] = _to_device(uniforms, self.device)

    def compact(self, holes: list[int], fillers: list[int], positions: int) -> None:
        """Exchange rows ``holes[k]`` and ``fillers[k]`` (:func:`~spader_pipeline.modeling.batching.retire_rows`)
        in every buffer: the first ``positions`` positions of the caches (what was written so far), the row
        state whole. One indexed copy per buffer, whatever the number of pairs."""
        if not holes:
            return
        rows = torch.tensor(holes + fillers, device=self.device)
        sources = torch.tensor(fillers + holes, device=self.device)
        for buffer in [*self.keys, *self.values, *([self.states] if self.states is not None else [])]:
            buffer[rows, :, :positions] = buffer[sources, :, :positions]
        for buffer in (self.valid, self.first, self.token, self.position, self.budget, self.done, self.count,
                       self.tokens, self.log_probs):
            buffer[rows] = buffer[sources]
        self.uniforms[:, rows] = self.uniforms[:, sources]


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from pinned memory without waiting on CUDA (no synchronisation)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
