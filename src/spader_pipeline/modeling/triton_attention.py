"""A decoding step's attention as one Triton kernel: each row's query heads over its cached keys and values,
reading the grouped key/value heads once and no position past the step's last one.

The static step (:mod:`~spader_pipeline.modeling.graph_decode`) attends one query position per row over a
length bucket of the static cache, ``[rows, H_kv, L, D]``, with a mask of the positions each row holds
(its left padding and a turn's padding are holes). SDPA takes that as an additive mask, so it cannot use
flash's kernel, and it reads the bucket's whole length, up to ``L - cursor - 1`` positions past the last
one written (a bucket of 256 over ~560 real positions reads ~200 more). Here one program per row and
key/value head (the flash-decoding layout of vLLM's and SGLang's Triton kernels, without their split of
the positions: at hundreds of rows the rows alone fill the GPU):

- the group's ``H / H_kv`` query heads are the rows of one ``[16, D]`` tile (padded to the 16 rows a
  tensor-core product needs), so each key and value is read once for the group;
- positions are read in blocks of ``BLOCK_N`` from the block of each row's first held position (its left
  padding skipped) up to ``end`` (the step's last position + 1); both read from the device, so a captured
  graph stays valid as the cursor moves and rows change places; each block's mask applied to its scores:
  a loop the compiler pipelines (its loads asynchronous copies into shared memory, checked in the sm_90
  build's PTX); Triton's interpreter, which cannot run a range over a loaded bound, runs the same blocks
  in a while loop;
- the softmax is the online one (running maximum and sum in fp32), the probabilities cast to the values'
  dtype for their product, as flash attention computes; the output is ``out / sum`` in the query's dtype.

Numerics: within bf16's rounding of SDPA's kernels, not equal to them (another summation order); the
gpu-marked tests hold it to the same bound as SDPA's path. ``available()``: Triton importable and (on a
CPU) its interpreter on (``TRITON_INTERPRET=1``), which the CPU tests use.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["BLOCK_N", "DEFAULT_LAUNCH", "GROUP_ROWS", "LAUNCH", "LAUNCH_ENV", "available", "fits",
           "grouped_decode_attention", "launch", "launch_name"]

#: positions a program reads per iteration
BLOCK_N = 64
#: the kernel's launch: (positions an iteration, warps, the loop's pipelining stages)
DEFAULT_LAUNCH = (BLOCK_N, 4, 3)
LAUNCH_ENV = "SPADER_TRITON_LAUNCH"
#: ``block,warps,stages`` in place of :data:`DEFAULT_LAUNCH` (empty: the default): the launch a lease's
#: attention benchmark found the fastest on its GPU (``gpu_issue63.sh profile`` sets it for that lease's run)
LAUNCH = os.environ.get(LAUNCH_ENV, "").strip()
#: the query tile's rows: a tensor-core product needs 16 (Qwen3-8B's group of 4, SmolLM2's 3, fit)
GROUP_ROWS = 16


@functools.cache
def available() -> bool:
    """Whether Triton imports here (with a CUDA device, or its CPU interpreter on)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def fits(group: int, head_dim: int) -> bool:
    """Whether the kernel takes a model's shape: a group of at most :data:`GROUP_ROWS` query heads per
    key/value head, a head dimension that is a power of two of at least 16 (a tensor-core product's)."""
    return group <= GROUP_ROWS and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def launch() -> tuple[int, int, int]:
    """:data:`LAUNCH` parsed (``block,warps,stages``), or :data:`DEFAULT_LAUNCH`; a value the kernel cannot take
    (a block that is not a power of two of at least 16, warps not a power of two up to 16, stages not 1-8)
    is refused with the expected form."""
    return _parsed_launch(LAUNCH)


@functools.cache
def _parsed_launch(value: str) -> tuple[int, int, int]:
    if not value:
        return DEFAULT_LAUNCH
    try:
        block, warps, stages = (int(part) for part in value.split(","))
    except ValueError:
        block = warps = stages = 0
    if not (block >= 16 and block & (block - 1) == 0 and 1 <= warps <= 16 and warps & (warps - 1) == 0
            and 1 <= stages <= 8):
        raise ValueError(f"{LAUNCH_ENV}={value!r}: block,warps,stages (e.g. 64,4,3: a block a power of two "
                         "of at least 16, warps a power of two up to 16, 1-8 stages)")
    return block, warps, stages


def launch_name() -> str:
    """``triton``, with the launch where it is not :data:`DEFAULT_LAUNCH` (``triton 64/8/3``): what a run's
    decoding path records."""
    chosen = launch()
    return "triton" if chosen == DEFAULT_LAUNCH else "triton " + "/".join(map(str, chosen))


@functools.cache
def _kernel():
    from spader_pipeline.modeling.triton_decode_kernel import decode_attention_kernel

    return decode_attention_kernel


def grouped_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                             end: torch.Tensor, scale: float, *, first: torch.Tensor | None = None,
                             over_length: bool = False, block: int | None = None, warps: int | None = None,
                             stages: int | None = None) -> torch.Tensor:
    """Attention of one query position per row over the first ``end`` cached positions it holds.

    query ``[n, H_kv, G, D]`` (key/value head ``j``'s query heads ``j*G .. j*G+G-1``, as transformers' ``repeat_kv``
    pairs them); keys, values ``[n, H_kv, L, D]`` (the last dimension contiguous: views of a cache with room
    for more positions are fine); valid bool ``[n, L]`` (the positions each row attends to); end long ``[1]`` on
    the device (positions ``>= end`` are not read; ``end <= L``); every row must hold a position below
    ``end``. ``first`` long ``[n]`` on the device (optional): each row's first held position, the blocks wholly
    before it not read (a row's left padding: a rollout's rows end together, right-aligned; with ``over_length``
    every block is read, masked). Returns
    ``[n, H_kv, G, D]`` in the query's dtype. ``D`` a power of two ≥ 16, ``G`` ≤ 16.
    ``over_length``: loop over the view's ``L`` positions (a kernel compiled per ``L``), those past ``end``
    masked and not loaded, instead of up to ``end`` (which runs faster on a GPU is a benchmark's question:
    bench_gpu_attention.py). ``block`` (positions an iteration, a power of two ≥ 16), ``warps`` and ``stages``
    (the loop's pipelining depth): the launch, each by default :func:`launch`'s.
    """
    rows, kv_heads, group, dim = query.shape
    if not fits(group, dim):
        raise ValueError(f"grouped_decode_attention: group {group} (at most {GROUP_ROWS}), head dim {dim} "
                         "(a power of two, at least 16)")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("grouped_decode_attention: the head dimension must be contiguous")
    chosen = launch()
    block, warps, stages = block or chosen[0], warps or chosen[1], stages or chosen[2]
    out = torch.empty_like(query)
    valid = valid if valid.stride(-1) == 1 else valid.contiguous()
    _kernel()[(rows, kv_heads)](
        query, keys, values, valid.view(torch.uint8), end, first if first is not None else end, out, scale,
        query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), valid.stride(0), out.stride(0), out.stride(1),
        out.stride(2), GROUP=group, GROUP_PAD=GROUP_ROWS, DIM=dim, BLOCK=block,
        LENGTH=keys.shape[2] if over_length else 0,
        # fp32 products in fp32 (Triton's default for fp32 tiles is TF32: 10 bits), as SDPA's fp32 kernels
        PRECISION="ieee" if query.dtype == torch.float32 else None,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", HAS_FIRST=first is not None, num_warps=warps,
        num_stages=stages)
    return out
