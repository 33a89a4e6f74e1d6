"""A KV cache that grows in place: decoding appends into spare capacity instead of copying.

transformers' ``DynamicCache`` appends each decoding step's keys/values with ``torch.cat``, which
copies the whole cache of every layer at every step: at batch 44 and 400 cached tokens that is
~0.6 GB of memory traffic per step for SmolLM2, about as much as reading the weights.
:class:`GrowingKVCache` keeps each layer's keys/values ``[B, H_kv, capacity, D]`` in a buffer with
spare room; a step writes its new positions in place and attention reads the filled part
``[:, :, :length]`` as a view. The buffer is reallocated (one copy) only when it is full, growing
geometrically, so a turn of generation copies the cache about once instead of once per token.

It is a :class:`transformers.DynamicCache` for every caller (``generate``, a model's forward,
``batch_select_indices``): same contents, same lengths, same attention results. The static cache
of transformers avoids the copies too but attends over its whole fixed length and cannot continue
a cache across calls of different widths, which our KV reuse between turns needs
(:class:`spader_pipeline.agent.hf_backend.HFGenerator`).

For decoding that drops finished rows (:func:`spader_pipeline.modeling.decode.decode_batch`) the
cache can expose only its first ``rows`` rows to the model (:meth:`GrowingKVCache.set_active_rows`)
and move rows in place (:meth:`GrowingKVCache.move_rows`, one indexed copy per buffer for any number
of rows): finished rows are exchanged with going rows behind them and stop being computed, without copying the cache of the rows that go on. Positions
past a row's last write hold zeros (never uninitialised memory), so a masked position can never
turn attention into NaN.

A prefill whose rows bring different numbers of new tokens can run as several forwards over blocks of
rows, each padded only to its own longest row (:meth:`GrowingKVCache.row_window`), and a long fresh
prefill as forwards over chunks of rows (the first chunk allocates the cache, :meth:`GrowingKVCache.
add_rows` makes room for the others): a window exposes
rows ``[start, stop)`` with ``length`` cached positions, so the model appends that block's positions
after ``length``; :meth:`GrowingKVCache.close_windows` exposes every row again, as long as the
furthest write. A block's rows then hold zeros (masked) between their last write and that length.

A cache decoded by captured CUDA graphs (:mod:`~spader_pipeline.modeling.graph_decode`) lives in the
static cache's buffers from its first decoding call on (:meth:`GrowingKVCache.move_storage`): every
operation above keeps working there in place, and one that needs more room reallocates as always, leaving
them. Their positions past a row's last write hold finite values, not zeros.

Reordering rows (:meth:`GrowingLayer.batch_select_indices` with distinct rows: the rows a decoding call
left permuted, a blocked prefill's order) and closing the masked gaps of rows
(:meth:`GrowingLayer.gather_positions`) rearrange the filled part of every buffer. On a CPU that runs in
place a row at a time: a new buffer of a long cache costs its page faults on top of the copy. On a GPU
(every device but those in :data:`ROW_BY_ROW_DEVICES`) it is one indexed copy per buffer: a row at a
time there dispatches a few operations per row and buffer, each a launch or the host's time before one
(~143,000, views left out, for a turn's reorder and gap closing at 768 rows over 30 layers, 341 as one copy
per buffer: ``benchmarks/bench_cache_rearrange.py``), while the caching allocator hands out the temporary without
page faults.

For the native trainer the cache can also keep, per position, the hidden states one decoder block
wrote there (``GrowingKVCache(capture_states=True)``, :class:`GrowingStates`): the states follow
every cache operation exactly as the keys and values do, so after a rollout they line up with the
cached positions (:mod:`spader_pipeline.modeling.boundary` fills them from a forward hook).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from spader_pipeline.modeling.decode_attention import bf16_decode_attention_available, bf16_key_cache

__all__ = ["ROW_BY_ROW_DEVICES", "GrowingKVCache", "GrowingLayer", "GrowingStates"]

#: device types whose caches reorder rows and gather positions in place a row at a time (no new buffer to
#: fault in); elsewhere each buffer is rearranged in one indexed copy (no launch per row)
ROW_BY_ROW_DEVICES = frozenset({"cpu"})


class GrowingLayer(DynamicLayer):
    """One layer of :class:`GrowingKVCache`: ``keys``/``values`` are views ``[B, H_kv, length, D]``
    of buffers ``[B, H_kv, capacity, D]``; ``update`` writes in place while capacity lasts."""

    #: spare positions kept after a reallocation, at least (a turn of decoding fits without one)
    min_headroom = 64
    #: on a CPU, cache bf16 values beside fp32 keys in fp32 (:meth:`update`); ``False`` keeps them bf16
    #: (the layout ``autocast_bf16_values`` of benchmarks/profile_rollout.py, for comparison)
    fp32_values_on_cpu = True

    def __init__(self, config=None) -> None:
        super().__init__()  # 5.9/5.10: DynamicLayer ignores its config; 5.17: it takes none
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        self._furthest = 0  # furthest position written in any row (> _length inside a row window)
        self._row_start = 0  # rows exposed to the model: [_row_start, _rows)
        self._rows: int | None = None  # None: to the last row

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = 0) -> None:
        """Make ``keys``/``values`` (``[B, H_kv, S, D]``) the contents, with ``headroom`` spare positions."""
        batch, heads, length, dim = keys.shape
        self._key_buffer = keys.new_empty((batch, heads, length + headroom, dim))
        self._value_buffer = values.new_empty((batch, heads, length + headroom, values.shape[-1]))
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self._key_buffer[:, :, length:] = 0  # spare room is zeros: rows left out of a step stay finite
        self._value_buffer[:, :, length:] = 0
        self._length = self._furthest = length
        self._expose()

    def _expose(self) -> None:
        self.keys = self._key_buffer[self._row_start : self._rows, :, : self._length]
        self.values = self._value_buffer[self._row_start : self._rows, :, : self._length]

    def set_active_rows(self, rows: int | None) -> None:
        """Expose (and let ``update`` write) only the first ``rows`` rows; ``None``: all rows."""
        self.set_window(0, rows, self._length)

    def set_window(self, start: int, stop: int | None, length: int) -> None:
        """Expose rows ``[start, stop)`` with their first ``length`` positions (``length`` at most the
        current length): the next ``update`` writes these rows' new positions after ``length``."""
        if length > self._length:
            raise ValueError(f"a window of {length} positions on a cache of {self._length}")
        self._row_start, self._rows, self._length = start, stop, length
        if self._key_buffer is not None:
            self._expose()

    def close_window(self) -> None:
        """Expose every row again, as long as the furthest position any window wrote."""
        self._row_start, self._rows, self._length = 0, None, self._furthest
        if self._key_buffer is not None:
            self._expose()

    def add_rows(self, rows: int) -> None:
        """Grow to ``rows`` rows, the new ones empty (zeros, as spare positions are), length and capacity
        kept: a prefill that filled the first rows goes on with the others through row windows."""
        if self._key_buffer is None or rows <= self._key_buffer.shape[0]:
            return
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros((rows, *old.shape[1:]))
            new[: old.shape[0]] = old
            setattr(self, name, new)
        self._expose()

    def gather_positions(self, index: torch.Tensor) -> None:
        """Keep, for every row ``b``, positions ``index[b]`` (``[B, L']``, ``L'`` at most the length,
        each index ``< length``): the cache becomes ``L'`` long, in place (on a CPU a row at a time
        through a small copy, elsewhere one gather per buffer; the freed positions are zeroed, the
        capacity kept)."""
        if self._key_buffer is None:
            return
        index = index.to(self._key_buffer.device)
        rows, length, new_length = index.shape[0], self._length, index.shape[1]
        if new_length > length:
            raise ValueError(f"gathering {new_length} positions from a cache of {length}")
        row_by_row = self._key_buffer.device.type in ROW_BY_ROW_DEVICES
        for buffer in (self._key_buffer, self._value_buffer):
            if row_by_row:
                for row in range(rows):
                    buffer[row, :, :new_length] = buffer[row, :, :length].index_select(1, index[row])
            else:  # [rows, H, L', D]: each row's positions, for every head and channel
                where = index[:, None, :, None].expand(rows, buffer.shape[1], new_length, buffer.shape[3])
                buffer[:rows, :, :new_length] = torch.gather(buffer[:rows, :, :length], 2, where)
            buffer[:, :, new_length:length] = 0
        self._length = self._furthest = new_length
        self._expose()

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows ``i`` and ``j`` of the filled positions (two rows copied)."""
        if i != j:
            self.move_rows(torch.tensor([i, j]), torch.tensor([j, i]))

    def move_rows(self, rows: torch.Tensor, sources: torch.Tensor) -> None:
        """Make row ``rows[k]`` of the filled positions what row ``sources[k]`` was, for every ``k``
        (long ``[n]``; ``sources`` distinct, e.g. a permutation of ``rows``: all are read before any is
        written): one gather and one scatter per buffer."""
        if self._key_buffer is not None and len(rows):
            device = self._key_buffer.device
            rows, sources = rows.to(device), sources.to(device)
            for buffer in (self._key_buffer, self._value_buffer):
                buffer[rows, :, : self._length] = buffer[sources, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` ``[B, H_kv, T, D]``; return the whole cache (views).

        On a GPU, keys are stored in the values' dtype. Under bf16 autocast the rotary embedding's fp32
        cos/sin promote the bf16 key projection to fp32 while the values stay bf16; attention (autocast
        casts its inputs to bf16) then read an fp32 key cache and cast all of it again at every step.
        Stored in bf16 the cache is a third smaller and the attention gets the same bf16 keys. On a
        CPU a decoding step attends in fp32, and the keys are rounded to bf16 as on a GPU
        (:func:`~spader_pipeline.modeling.decode_attention.bf16_key_cache`, the default; the prefill's
        attention under autocast reads the same bf16 keys). Where the native attention reads the cache
        (:func:`~spader_pipeline.modeling.decode_attention.bf16_decode_attention_available`) they are
        stored in bf16: half the bytes a step reads. Elsewhere SDPA attends in fp32
        (:func:`spader_pipeline.modeling.attention.sdpa_gqa_attention_forward`), so keys and values are
        stored in fp32, holding the bf16 values exactly: a step reads the cache as it is instead of
        casting all of it to a new fp32 tensor (benchmarks/profile_rollout.py), and the same bf16 keys
        give SDPA's result on the widened bf16 cache. Without the bf16 key cache the keys keep their
        fp32 values. Prefill under autocast casts the cache back to the same bf16.
        """
        if key_states.dtype != value_states.dtype:
            if key_states.device.type != "cpu" or bf16_decode_attention_available():
                key_states = key_states.to(value_states.dtype)
            elif key_states.dtype == torch.float32:
                if bf16_key_cache():  # bf16 keys held in fp32: widened once, not at every step's attention
                    key_states = key_states.to(value_states.dtype).float()
                if self.fp32_values_on_cpu:
                    value_states = value_states.float()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._key_buffer is None:
            self._adopt(key_states, value_states, headroom=max(self.min_headroom, new // 2))
            return self.keys, self.values
        keys, values = self.reserve(new)
        keys[:, :, -new:] = key_states
        values[:, :, -new:] = value_states
        return keys, values

    def reserve(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the exposed rows by ``new`` positions and return the whole cache (views ``[b, H_kv,
        length + new, D]``) for the caller to write the last ``new`` positions: :meth:`update` without
        its copy, for a step that writes them itself (:mod:`~spader_pipeline.modeling.native_step`).
        The cache must hold something already."""
        if self._key_buffer is None:
            raise ValueError("reserve on an empty cache: the first update allocates it")
        end = self._length + new
        if end > self._key_buffer.shape[-2]:  # full: reallocate with room to grow (one copy, every row)
            length, kept = self._length, max(self._length, self._furthest)
            self._adopt(self._key_buffer[:, :, :kept], self._value_buffer[:, :, :kept],
                        headroom=max(end - kept, 0) + new + max(self.min_headroom, end // 2))
            self._length = length
        self._length = end
        self._furthest = max(self._furthest, end)
        self._expose()
        return self.keys, self.values

    def holds(self, key_buffer: torch.Tensor) -> bool:
        """Whether this layer's keys live in ``key_buffer`` (the same memory, shape and strides)."""
        mine = self._key_buffer
        return (mine is not None and mine.data_ptr() == key_buffer.data_ptr() and mine.shape == key_buffer.shape
                and mine.stride() == key_buffer.stride())

    def move_storage(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> None:
        """Keep the contents in ``key_buffer``/``value_buffer`` from now on (``[B, H_kv, capacity, D]``, this
        layer's rows, at least its filled positions: e.g. views of a static cache's buffers, which a captured
        decoding step writes in place), the filled positions copied there unless they are there already.
        Positions past them keep what they held: finite values (a position is masked until it is written),
        not necessarily zeros."""
        if self._key_buffer is None:
            raise ValueError("move_storage on an empty layer: the first update allocates it")
        if not self.holds(key_buffer):
            kept = max(self._length, self._furthest)
            key_buffer[:, :, :kept] = self._key_buffer[:, :, :kept]
            value_buffer[:, :, :kept] = self._value_buffer[:, :, :kept]
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._expose()

    def own_storage(self) -> None:
        """Move the contents into buffers of this layer's own, of the same shape (:meth:`move_storage`):
        before the memory it shared is handed to another cache."""
        if self._key_buffer is not None:
            self.move_storage(self._key_buffer.new_zeros(self._key_buffer.shape),
                              self._value_buffer.new_zeros(self._value_buffer.shape))

    def get_seq_length(self) -> int:
        return self._length if self._key_buffer is not None else 0

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self._length - abs(max_length)
        if self._key_buffer is not None and max_length < self._length:
            self._length = self._furthest = max(0, max_length)
            self._key_buffer[:, :, self._length :] = 0  # keep the spare room zeros
            self._value_buffer[:, :, self._length :] = 0
            self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (one copy of the buffers, capacity kept)."""
        if self.get_seq_length() > 0:
            self._key_buffer = self._key_buffer.repeat_interleave(repeats, dim=0)
            self._value_buffer = self._value_buffer.repeat_interleave(repeats, dim=0)
            self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (repeats allowed: a shared prefix copied to several rows), capacity kept.

        Distinct rows (a reordering, or the trajectories still going) move in place: on a CPU along a
        permutation's cycles, each filled row copied once and no new buffer (a new buffer of a long cache
        costs its page faults on top of the copy), elsewhere in one indexed copy per buffer of the kept rows
        (:meth:`move_rows`); repeated rows are copied to a new one.
        """
        if self.get_seq_length() == 0:
            return
        rows = [int(r) for r in indices.tolist()]
        if len(set(rows)) < len(rows):
            indices = indices.to(self._key_buffer.device)
            self._key_buffer = self._key_buffer.index_select(0, indices)
            self._value_buffer = self._value_buffer.index_select(0, indices)
        else:
            if self._key_buffer.device.type in ROW_BY_ROW_DEVICES:
                kept = set(rows)
                source = rows + [r for r in range(self._key_buffer.shape[0]) if r not in kept]  # a permutation
                for buffer in (self._key_buffer, self._value_buffer):
                    _permute_rows(buffer[:, :, : self._length], source)
            else:  # the kept rows read, then written to the first ones
                self.move_rows(torch.arange(len(rows)), indices)
            self._key_buffer, self._value_buffer = self._key_buffer[: len(rows)], self._value_buffer[: len(rows)]
        self._expose()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def offload(self) -> None:
        if self._key_buffer is not None:
            self._key_buffer = self._key_buffer.to("cpu", non_blocking=True)
            self._value_buffer = self._value_buffer.to("cpu", non_blocking=True)
            self._expose()

    def prefetch(self) -> None:
        if self._key_buffer is not None and self._key_buffer.device != self.device:
            self._key_buffer = self._key_buffer.to(self.device, non_blocking=True)
            self._value_buffer = self._value_buffer.to(self.device, non_blocking=True)
            self._expose()

    def reset(self) -> None:
        self._length = self._furthest = 0
        if self._key_buffer is not None:
            self._key_buffer.zero_()
            self._value_buffer.zero_()
            self._expose()


def _permute_rows(tensor: torch.Tensor, source: list[int]) -> None:
    """Make row ``b`` of ``tensor`` what row ``source[b]`` was (``source``: a permutation), in place:
    each cycle of the permutation is walked with one spare row."""
    done = [False] * len(source)
    for start in range(len(source)):
        if done[start] or source[start] == start:
            continue
        spare = tensor[start].clone()
        row = start
        while source[row] != start:
            tensor[row] = tensor[source[row]]
            done[row] = True
            row = source[row]
        tensor[row] = spare
        done[row] = True


class GrowingStates(GrowingLayer):
    """Per-position hidden states ``[B, 1, capacity, H]`` that move with a :class:`GrowingKVCache`.

    A :class:`GrowingLayer` whose keys are the states and whose values are empty (``[B, 1, capacity,
    0]``): every operation (append, active rows, row swaps, position gathering, row selection with
    repeats, repetition, cropping, reset) runs the key/value layers' own code, so position ``p`` of
    row ``b`` always holds the state of the token whose keys are at ``[b, :, p]`` in the cache.
    """

    def append(self, states: torch.Tensor) -> None:
        """Append ``states`` ``[b, T, H]`` (``b``: the active rows) at the next ``T`` positions."""
        self.update(states[:, None], states.new_empty((states.shape[0], 1, states.shape[1], 0)))

    @property
    def states(self) -> torch.Tensor:
        """The filled positions ``[b, length, H]`` of the exposed rows (a view)."""
        return self.keys[:, 0]


class GrowingKVCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`GrowingLayer` (created lazily, one per decoder layer).

    ``capture_states=True`` adds :attr:`states`, a :class:`GrowingStates` buffer that every cache
    operation below applies to as well (``None`` otherwise).
    """

    def __init__(self, *, capture_states: bool = False) -> None:
        super().__init__()
        self.layer_class_to_replicate = GrowingLayer
        self.states: GrowingStates | None = GrowingStates() if capture_states else None

    def _extra(self) -> list[GrowingLayer]:
        return [self.states] if self.states is not None else []

    def set_active_rows(self, rows: int | None) -> None:
        """Let the model see and extend only the first ``rows`` rows of every layer (``None``: all)."""
        for layer in [*self.layers, *self._extra()]:
            layer.set_active_rows(rows)

    def row_window(self, start: int, stop: int, length: int) -> None:
        """Expose rows ``[start, stop)`` with ``length`` cached positions in every layer
        (:meth:`GrowingLayer.set_window`); the model's next forward appends after ``length``."""
        for layer in [*self.layers, *self._extra()]:
            layer.set_window(start, stop, length)

    def add_rows(self, rows: int) -> None:
        """Grow every layer to ``rows`` rows, the new ones empty (:meth:`GrowingLayer.add_rows`)."""
        for layer in [*self.layers, *self._extra()]:
            layer.add_rows(rows)

    def close_windows(self) -> None:
        """Expose every row of every layer again, as long as the furthest write."""
        for layer in [*self.layers, *self._extra()]:
            layer.close_window()

    def gather_positions(self, index: torch.Tensor) -> None:
        """Keep positions ``index[b]`` of every row ``b`` in every layer (``index``: ``[B, L']``)."""
        for layer in [*self.layers, *self._extra()]:
            layer.gather_positions(index)

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows ``i`` and ``j`` in every layer."""
        for layer in [*self.layers, *self._extra()]:
            layer.swap_rows(i, j)

    def move_rows(self, rows: torch.Tensor, sources: torch.Tensor) -> None:
        """Make row ``rows[k]`` what row ``sources[k]`` was in every layer (``sources`` distinct,
        :meth:`GrowingLayer.move_rows`); the index moves to the device once."""
        layers = [*self.layers, *self._extra()]
        buffers = [layer._key_buffer for layer in layers if layer._key_buffer is not None]
        if buffers and len(rows):
            rows, sources = rows.to(buffers[0].device), sources.to(buffers[0].device)
        for layer in layers:
            layer.move_rows(rows, sources)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        for layer in self._extra():
            layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        for layer in self._extra():
            layer.batch_repeat_interleave(repeats)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        for layer in self._extra():
            layer.reorder_cache(beam_idx)

    def reserve(self, new: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Extend every decoder layer by ``new`` positions (:meth:`GrowingLayer.reserve`): each layer's
        keys and values (views), their last ``new`` positions for the caller to write. Not the
        captured states, which their own ``append`` extends."""
        reserved = [layer.reserve(new) for layer in self.layers]
        return [keys for keys, _ in reserved], [values for _, values in reserved]

    def move_storage(self, key_buffers: list[torch.Tensor], value_buffers: list[torch.Tensor],
                     states: torch.Tensor | None = None) -> None:
        """Keep every decoder layer's contents in its ``key_buffers``/``value_buffers`` entry, and the
        captured states in ``states`` (``[B, 1, capacity, H]``) where given (:meth:`GrowingLayer.move_storage`):
        a static cache's buffers, which captured decoding steps write in place."""
        for layer, keys, values in zip(self.layers, key_buffers, value_buffers, strict=True):
            layer.move_storage(keys, values)
        if states is not None and self.states is not None and self.states._key_buffer is not None:
            self.states.move_storage(states, states.new_empty((*states.shape[:3], 0)))

    def own_storage(self, shared: set[int]) -> None:
        """Every layer (the states too) whose keys live at a data pointer in ``shared`` moves into buffers
        of its own (:meth:`GrowingLayer.own_storage`): the memory is about to hold another cache."""
        for layer in [*self.layers, *self._extra()]:
            if layer._key_buffer is not None and layer._key_buffer.data_ptr() in shared:
                layer.own_storage()

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        for layer in self._extra():
            layer.crop(max_length)

    def reset(self) -> None:
        super().reset()
        for layer in self._extra():
            layer.reset()
