"""Decoding steps without host overhead: the model's step over a static cache, its tokens drawn on the
device, captured in CUDA graphs per bucket of rows and positions.

On one H200 a decoding step of SmolLM2 through the model's forward took ~33 ms at 256 or 768 rows,
while its arithmetic and its reads of the cache take ~2-3 ms (docs/gpu.md, issue 63): the step was the
host launching some thousand small kernels one by one, autocast casting every fp32 weight to bf16 again
at every step, and the host reading every step's tokens to see which rows ended. llama.cpp runs the same
step as one CUDA graph over bf16 weights (9.4 ms), and so does transformers' compiled static-cache
``generate`` (10.0 ms). This module is that step for :func:`~spader_pipeline.modeling.decode.decode_batch`:

* **bf16 weights, cast once**: the products read bf16 copies of the weights (q|k|v and gate|up stacked,
  each one product), made once and refreshed in place when a weight changes (its version counter: an
  optimiser step, a weight sync; torch's fused optimisers do not bump it, so the native trainer's AdamW is
  not fused), instead of autocast's cast of every weight at every step. Under autocast the rest is what
  autocast computes: the residual stream, norms and rotary embedding in fp32, the products' inputs cast to
  bf16 (the same values, so the same products as autocast's); on CUDA the norms are one kernel each;
* **a static key/value cache** (:class:`~spader_pipeline.modeling.static_cache.StaticKVCache`) sized by
  buckets of the real length, which the turn's :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache`
  lives in from its first decoding call (no copy per turn; a cache that outgrows it, or another batch's,
  moves once);
* **grouped-query attention without expanding the key/value heads**: each key/value head's query heads
  are the query positions of one SDPA call over that head's keys (``[rows, H_kv, H / H_kv, D]``), the
  shape of a decoding step of any grouped model; on a CPU under autocast it is the CPU's own decoding
  attention (:func:`~spader_pipeline.modeling.decode_attention.decode_attention`, fp32 over the cache);
  with ``SPADER_DECODE_ATTENTION=triton``, one Triton kernel that reads no position past the step's last
  (:mod:`~spader_pipeline.modeling.triton_attention`);
* **sampling and log-probabilities on the device**: the logits processors that read only the scores
  (:data:`GRAPH_PROCESSORS`), the inverse-CDF draw from uniform numbers drawn for the whole turn at its
  start (the same numbers, row by row, as the host loop draws step by step), each token's log-probability,
  and each row's end (an end token or its budget) kept as a device flag; the host reads which rows ended
  every :data:`~spader_pipeline.modeling.static_cache.SYNC_EVERY` steps, not at every step, and moves
  the ended rows behind the going ones when those fit a smaller row bucket;
* **one CUDA graph per bucket** of rows and positions (``torch.cuda.CUDAGraph``, all sharing one memory
  pool), captured the first time its bucket decodes (that step runs eagerly first, which also warms its
  kernels) and replayed after: the capture is paid once per process, bucket and allocation, logged and
  counted (:func:`static_decode_stats`).

The step is written so that it can be captured: every shape is fixed per bucket, nothing in it reads the
device from the host, and every input is read from the static buffers (the cursor, the step's index, the
tokens, the positions). The boundary states the native trainer's update starts from are written into the
static cache's states at the captured block, as :mod:`~spader_pipeline.modeling.boundary`'s hook would.

Where it runs (:func:`static_decoder`): a supported family (:data:`~spader_pipeline.modeling.decode_step.
SUPPORTED_MODEL_TYPES`) without biases or a dynamic rotary embedding, under bf16 autocast or in its own
fp32 or bf16, with the switches of :mod:`~spader_pipeline.modeling.static_cache` (by default on CUDA; the
tests force it on the CPU, where the same step runs eagerly, its products computed as the host loop computes
them, :data:`PRODUCTS`, so that the tests hold it to the host loop's bits).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spader_pipeline.modeling import packed_linear, static_cache, triton_step
from spader_pipeline.modeling.attention import NAME as GQA_ATTENTION
from spader_pipeline.modeling.batching import retire_rows
from spader_pipeline.modeling.decode_attention import (
    bf16_decode_attention_available,
    bf16_key_cache,
    decode_attention,
)
from spader_pipeline.modeling.decode_step import (
    CAPTURED_BLOCK,
    _fused_norm_matches,
    _has_foreign_hooks,
    _residual_norm,
    decoder_linears,
    fused_decode_step_applies,
    rotated_query_keys,
)
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.packed_linear import packed_product, packed_weights, packing_available
from spader_pipeline.modeling.sampling import sample_categorical, token_log_probs
from spader_pipeline.modeling.static_cache import StaticKVCache, allocation_length, length_bucket, row_bucket
from spader_pipeline.modeling.triton_attention import fits as triton_fits
from spader_pipeline.modeling.triton_attention import grouped_decode_attention

__all__ = ["GRAPH_PROCESSORS", "SYNC_CHECK", "StaticOutcome", "decode_static", "release_static_decoders",
           "static_decode_stats", "static_decoder"]

logger = logging.getLogger(__name__)

#: logits processors the device's sampling runs (they read only the scores, and nothing in them reads the
#: device from the host); with any other, decoding runs the host loop
GRAPH_PROCESSORS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"})
#: run every step (a replay, or an eager step) under ``torch.cuda.set_sync_debug_mode("error")``: a step
#: that reads the device from the host raises (the gpu-marked tests set it)
SYNC_CHECK = False
#: rotary embeddings whose tables change with the positions seen (transformers' ``dynamic_rope_update``)
DYNAMIC_ROPE = ("dynamic", "longrope")

#: this process's counters (:func:`static_decode_stats`)
_STATS = {"buckets": 0, "captures": 0, "capture_seconds": 0.0, "replays": 0, "eager_steps": 0, "allocations": 0,
          "allocated_bytes": 0, "moved_in": 0, "evictions": 0}
#: per model: per precision, its decoder
_DECODERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, _Decoder]] = weakref.WeakKeyDictionary()
_graphs_failed = False


def static_decode_stats() -> dict[str, float]:
    """This process's counters: ``buckets`` (steps built for a new bucket of rows, positions and sampling:
    each is captured once where graphs are on, so a CPU run tells how many captures a GPU run pays),
    ``captures`` (CUDA graphs captured) and ``capture_seconds`` (their time,
    each bucket's first eager step included), ``replays``, ``eager_steps`` (steps launched op by op:
    without graphs, or a bucket's first step), ``allocations`` and ``allocated_bytes`` (static caches
    allocated, and the bytes of the latest), ``moved_in`` (caches copied into a static cache) and
    ``evictions`` (caches moved out of it for another batch)."""
    return dict(_STATS)


@dataclass(frozen=True)
class _Precision:
    """The dtypes of a step: the products' (inputs and weights), the residual stream's (the embedding's),
    the cache's, whether keys are rounded to bf16 before they are stored (in fp32), and the attention's:
    SDPA in that dtype, or (``None``) the CPU's fp32 decoding attention over the cache."""

    product: torch.dtype
    residual: torch.dtype
    kv: torch.dtype
    round_keys: bool
    attention: torch.dtype | None


def _precision(model: torch.nn.Module, linears: list[torch.nn.Linear], device: torch.device) -> _Precision | None:
    """What the model's own decoding forward computes in, here and now: under bf16 autocast from fp32 weights
    (the cache as :meth:`~spader_pipeline.modeling.kv_cache.GrowingLayer.update` stores it, the attention as
    the model's attends: autocast's bf16 SDPA, or on a CPU with ``sdpa_gqa`` the fp32 decoding attention), or
    in the weights' own fp32 or bf16. ``None`` for anything else (fp16, mixed weights, another autocast dtype)."""
    dtypes = {m.weight.dtype for m in linears} | {model.model.embed_tokens.weight.dtype}
    if len(dtypes) != 1 or any(m.weight.device != device for m in linears):
        return None
    weights = dtypes.pop()
    autocast = torch.is_autocast_enabled(device.type)
    if autocast and torch.get_autocast_dtype(device.type) != torch.bfloat16:
        return None
    if weights == torch.float32 and autocast:
        if device.type == "cpu":  # bf16 keys, stored in fp32 where the native attention does not read them
            native = bf16_decode_attention_available()
            fp32_decoding = getattr(model.config, "_attn_implementation", None) == GQA_ATTENTION
            return _Precision(torch.bfloat16, torch.float32, torch.bfloat16 if native else torch.float32,
                              not native and bf16_key_cache(), None if fp32_decoding else torch.bfloat16)
        return _Precision(torch.bfloat16, torch.float32, torch.bfloat16, False, torch.bfloat16)
    if weights in (torch.float32, torch.bfloat16):
        return _Precision(weights, weights, weights, False, weights)
    return None


class _ProductWeights:
    """The step's product weights at fixed addresses (a captured graph reads them there): each group of
    linear layers stacked along its outputs in the products' dtype, or the layer's own weight where nothing
    needs stacking or casting. A copy is refreshed in place when one of its sources changed."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.copies: list[tuple[tuple[torch.nn.Linear, ...], list[int], torch.Tensor]] = []

    def add(self, modules: tuple[torch.nn.Linear, ...]) -> _Product:
        if len(modules) == 1 and modules[0].weight.dtype == self.dtype:
            return _Product(modules, modules[0].weight.detach())
        weight = self._stacked(modules)
        self.copies.append((modules, [m.weight._version for m in modules], weight))
        return _Product(modules, weight)

    def _stacked(self, modules: tuple[torch.nn.Linear, ...]) -> torch.Tensor:
        return torch.cat([m.weight.detach() for m in modules]).to(self.dtype)

    def refresh(self) -> int:
        """Copy again every copy whose sources changed since; the number copied."""
        stale = 0
        for modules, versions, weight in self.copies:
            now = [m.weight._version for m in modules]
            if now != versions:
                weight.copy_(self._stacked(modules))
                versions[:] = now
                stale += 1
        return stale

    @property
    def nbytes(self) -> int:
        return sum(weight.numel() * weight.element_size() for _, _, weight in self.copies)


class _Product:
    """One product of the step: ``modules``' outputs side by side, ``[n, in] -> [n, sum of out]``, from their
    weights stacked in ``weight`` (``parts``: each module's rows of it, views that follow its refreshes)."""

    def __init__(self, modules: tuple[torch.nn.Linear, ...], weight: torch.Tensor) -> None:
        self.modules, self.weight = modules, weight
        self.parts = weight.split([m.out_features for m in modules]) if len(modules) > 1 else (weight,)


#: how the step computes its products (:meth:`_Step.product`): ``stacked``, one product per group over its
#: stacked copy (CUDA); on the CPU, the host loop's own products, which a test compares bit for bit: ``fused``
#: (:class:`~spader_pipeline.modeling.decode_step.FusedDecodeStep`'s: each group's weights stacked and packed
#: for oneDNN), ``packed`` (each module's packed weight: the model's forward under
#: :func:`~spader_pipeline.modeling.precision.bf16_inference`) or ``modules`` (each module's product, as
#: autocast computes it). One product over a stack is not each module's bit for bit: at small widths oneDNN
#: and ATen pick their kernels by the shape, and a kernel's sums round in its own order.
PRODUCTS = ("stacked", "fused", "packed", "modules")


def _host_products(model: torch.nn.Module, device: torch.device) -> str:
    """The :data:`PRODUCTS` the step computes on ``device`` now: ``stacked`` on CUDA, else the host loop's."""
    if device.type == "cuda":
        return "stacked"
    if fused_decode_step_applies(model):
        return "fused"
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    return "packed" if autocast and packed_linear.PACK_WEIGHTS and packing_available() else "modules"


def _signature(model: torch.nn.Module) -> tuple:
    """Where the model's tensors are (a captured graph reads them there): replaced tensors mean a new step."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


class _Step:
    """The model's decoding step over a :class:`StaticKVCache` (the arithmetic of
    :class:`~spader_pipeline.modeling.decode_step.FusedDecodeStep`, in :class:`_Precision`'s dtypes, with the
    products from :class:`_ProductWeights` and the attention over the static cache's views)."""

    def __init__(self, model: torch.nn.Module, precision: _Precision, device: torch.device) -> None:
        config, body = model.config, model.model
        self.precision, self.signature = precision, _signature(model)
        self.model = weakref.ref(model)  # the packed products' key (a strong one would keep the model alive)
        self.products = _host_products(model, device)  # set again per call (static_decoder)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.hidden, self.layers_count = config.hidden_size, len(body.layers)
        self.embed, self.rotary = body.embed_tokens.weight, body.rotary_emb
        # the residual stream's norms in one call: where it is the model's formula bit for bit (a CPU), and on
        # CUDA, where torch.rms_norm is one kernel (the formula six) that sums in another order: there the step
        # is held to the bf16 bound of the gpu-marked tests, not to the host loop's bits
        fused = precision.residual == torch.float32 and (
            device.type == "cuda" or _fused_norm_matches(config.hidden_size, device.type))
        self.weights = _ProductWeights(precision.product)
        self.layers = []
        for block in body.layers:
            attention, mlp = block.self_attn, block.mlp
            self.layers.append((
                _residual_norm(block.input_layernorm, fused),
                self.weights.add((attention.q_proj, attention.k_proj, attention.v_proj)),
                getattr(attention, "q_norm", None), getattr(attention, "k_norm", None), attention.scaling,
                self.weights.add((attention.o_proj,)),
                _residual_norm(block.post_attention_layernorm, fused),
                self.weights.add((mlp.gate_proj, mlp.up_proj)),
                self.weights.add((mlp.down_proj,)),
            ))
        self.final_norm = _residual_norm(body.norm, fused)
        self.head = self.weights.add((model.lm_head,))
        # the norms' modules in the order the fused kernels apply them: each block's two, then the final one
        self.norms = [norm for block in body.layers for norm in (block.input_layernorm, block.post_attention_layernorm)]
        self.norms.append(body.norm)
        # the fused kernels (triton_step) take a step whose residual stream is fp32 and whose attention reads
        # a query in its own dtype (CUDA's autocast precision, or fp32 weights), heads of a power of two
        self.fusable = (precision.residual == torch.float32 and precision.attention is not None
                        and not precision.round_keys and self.head_dim & (self.head_dim - 1) == 0)
        self._rotary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the additive mask's two values, made once (a step's mask is then one kernel, not three)
        self._mask_values = None if precision.attention is None else (
            torch.zeros((), dtype=precision.attention, device=self.embed.device),
            torch.full((), -torch.inf, dtype=precision.attention, device=self.embed.device))

    def rotary_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary ``cos``/``sin`` at positions ``0..length-1``, ``[length, D]`` in the residual
        stream's dtype (what its rotary embedding gives a row at each position: the same elementwise values), made
        once per static cache's length and before a capture, so that a step reads its rows' by position instead
        of computing them (~7 kernels). A row's position never passes its cursor, which stays below the
        length."""
        if length not in self._rotary:
            positions = torch.arange(length, device=self.embed.device)[None]
            cos, sin = self.rotary(self.embed[:1], positions)
            self._rotary[length] = (cos[0].contiguous(), sin[0].contiguous())
        return self._rotary[length]

    def product(self, x: torch.Tensor, product: _Product) -> torch.Tensor:
        """``x`` ``[n, in]`` times ``product``'s weights, in the products' dtype (:data:`PRODUCTS`)."""
        if self.products == "stacked":
            return F.linear(x.to(self.precision.product), product.weight)
        if self.products == "fused":
            return packed_product(x, packed_weights(self.model(), product.modules))
        if self.products == "packed":
            parts = [packed_product(x, packed_weights(self.model(), (m,))) for m in product.modules]
        else:
            x = x.to(self.precision.product)
            parts = [F.linear(x, weight) for weight in product.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """What every layer's attention reads of ``mask`` bool ``[n, L]`` (True: attend): itself for the CPU's
        decoding attention; for SDPA, the additive ``[n, 1, 1, L]`` mask SDPA would make of it in each
        layer (0 and -inf in the attention's dtype, as ATen's ``convert_boolean_attn_mask``), made once a step."""
        if self._mask_values is None:
            return mask
        return torch.where(mask[:, None, None, :], *self._mask_values)

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any,
                scaling: float) -> torch.Tensor:
        """One query position per row: ``query`` ``[n, H, D]`` over ``keys``/``values`` ``[n, H_kv, L, D]``
        where ``mask`` (:meth:`_attention_mask`); returns ``[n, H * D]``."""
        rows, heads, dim = query.shape
        dtype = self.precision.attention
        if dtype is None:  # the CPU's decoding attention under autocast (sdpa_gqa): fp32 over the cache
            return decode_attention(query.float()[:, :, None], keys, values, mask, scaling).reshape(rows, heads * dim)
        # query heads j*G .. j*G+G-1 read key/value head j (transformers' repeat_kv): G query positions of head j
        grouped = query.to(dtype).reshape(rows, self.kv_heads, heads // self.kv_heads, dim)
        if isinstance(mask, tuple):  # the Triton kernel: the positions held, from each row's first to the last
            valid, end, first = mask
            out = grouped_decode_attention(grouped, keys.to(dtype), values.to(dtype), valid, end, scaling, first=first)
        else:
            out = F.scaled_dot_product_attention(grouped, keys.to(dtype), values.to(dtype), attn_mask=mask,
                                                 scale=scaling)
        return out.reshape(rows, heads * dim)

    def forward(self, cache: StaticKVCache, rows: int, length: int, captured: int | None,
                attention: str = "sdpa", kernels: str = "aten") -> torch.Tensor:
        """Feed each of the first ``rows`` rows its ``token`` at ``position``, writing its keys, values (and the
        captured block's output) at ``cursor``, attending over the first ``length`` positions (``attention``
        ``triton``: up to ``cursor``, :mod:`~spader_pipeline.modeling.triton_attention`); :func:`_advance` moves
        ``position`` and ``cursor`` on after the sampling. ``kernels`` ``triton``: the work between the products
        as :mod:`~spader_pipeline.modeling.triton_step`'s kernels (where :attr:`fusable`). Returns the logits
        ``[rows, V]``."""
        cos, sin = self.rotary_tables(cache.length)
        position = cache.position[:rows]
        if kernels == "triton":  # the embedding, the position's mark and the first norm in one kernel
            norm = self.norms[0]
            x, normed = triton_step.embed_norm(cache.token[:rows], self.embed, norm.weight, norm.variance_epsilon,
                                               self.precision.product, cache.valid, cache.cursor)
        else:
            x = F.embedding(cache.token[:rows], self.embed)  # [n, hidden]: the residual stream
            cos, sin = cos.index_select(0, position)[:, None], sin.index_select(0, position)[:, None]  # [n, 1, D]
            cache.valid[:rows].index_fill_(1, cache.cursor, True)
        if attention == "triton":  # the runner names it only where the attention is SDPA's kind
            mask = (cache.valid[:rows, :length], cache.cursor + 1, cache.first[:rows])
        else:
            mask = self._attention_mask(cache.valid[:rows, :length])
        states = cache.states[:rows, 0] if captured is not None else None
        if kernels == "triton":
            return self._fused_blocks(x, normed, cos, sin, position, cache, rows, length, mask, captured, states)
        return self._blocks(x, cos, sin, cache, rows, length, mask, captured, states)

    def _blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache, rows: int,
                length: int, mask: Any, captured: int | None, states: torch.Tensor | None) -> torch.Tensor:
        """The blocks and the head in torch's operations: :meth:`forward`'s logits from the embedded ``x``."""
        precision, heads, kv_heads, dim = self.precision, self.heads, self.kv_heads, self.head_dim
        half = dim // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's sign, on sin
        # the query and the new keys cast together where the attention reads them in the cache's dtype
        joint_cast = precision.attention is not None and precision.attention == precision.kv
        for index, (norm_in, qkv_weight, q_norm, k_norm, scaling, o_weight, norm_mid, gate_up_weight,
                    down_weight) in enumerate(self.layers):
            qkv = self.product(norm_in(x), qkv_weight).view(rows, heads + 2 * kv_heads, dim)
            qk = rotated_query_keys(qkv, heads, kv_heads, q_norm, k_norm, cos, signed_sin)  # [n, H + H_kv, D]
            if joint_cast:
                qk = qk.to(precision.kv)
            new_keys = qk[:, heads:].to(torch.bfloat16) if precision.round_keys else qk[:, heads:]
            keys, values = cache.keys[index][:rows], cache.values[index][:rows]
            keys.index_copy_(2, cache.cursor, new_keys[:, :, None].to(precision.kv))
            values.index_copy_(2, cache.cursor, qkv[:, heads + kv_heads :, None].to(precision.kv))
            out = self._attend(qk[:, :heads], keys[:, :, :length], values[:, :, :length], mask, scaling)
            x = x + self.product(out, o_weight)
            gate_up = self.product(norm_mid(x), gate_up_weight)
            inner = gate_up.shape[-1] // 2
            x = x + self.product(F.silu(gate_up[:, :inner]) * gate_up[:, inner:], down_weight)
            if index == captured:
                states.index_copy_(1, cache.cursor, x[:, None].to(states.dtype))
        return self.product(self.final_norm(x), self.head)

    def _fused_blocks(self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      position: torch.Tensor, cache: StaticKVCache, rows: int, length: int, mask: Any,
                      captured: int | None, states: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_blocks` with the work between the products as :mod:`~spader_pipeline.modeling.triton_step`'s
        kernels: a block is its four products, the attention and four kernels (the residual's add fused into
        the next norm). ``x`` is the residual stream, updated in place, ``normed`` its first norm; ``cos``/``sin``
        the rotary tables ``[L, D]`` read at each row's ``position``. The products are CUDA's (one over each
        stacked copy, whatever :attr:`products` says: on a CPU only the interpreter's tests run this)."""
        product, heads, norms = self.precision.product, self.heads, self.norms
        query_dtype = self.precision.attention
        for index, (_, qkv_weight, q_norm, k_norm, scaling, o_weight, _, gate_up_weight,
                    down_weight) in enumerate(self.layers):
            qkv = F.linear(normed, qkv_weight.weight).view(rows, heads + 2 * self.kv_heads, self.head_dim)
            keys, values = cache.keys[index][:rows], cache.values[index][:rows]
            query = triton_step.rotary_cache(qkv, cos, sin, position, q_norm, k_norm, keys, values, cache.cursor,
                                             query_dtype, heads)
            out = self._attend(query, keys[:, :, :length], values[:, :, :length], mask, scaling)
            middle = norms[2 * index + 1]
            normed = triton_step.residual_norm(x, F.linear(out.to(product), o_weight.weight), middle.weight,
                                               middle.variance_epsilon, product)
            inner = triton_step.silu_mul(F.linear(normed, gate_up_weight.weight))
            after = norms[2 * index + 2]
            normed = triton_step.residual_norm(x, F.linear(inner, down_weight.weight), after.weight,
                                               after.variance_epsilon, product)
            if index == captured:
                states.index_copy_(1, cache.cursor, x[:, None].to(states.dtype))
        return F.linear(normed, self.head.weight)


@dataclass(frozen=True)
class _Sampling:
    """How a call draws and scores its tokens (a captured graph keeps these, so each has its own graphs)."""

    key: tuple
    processors: Any
    do_sample: bool
    temperature: float | None
    eos: torch.Tensor
    captured: int | None
    #: the temperature the fused sampling kernel (:func:`~spader_pipeline.modeling.triton_step.sample_step`)
    #: draws and scores with, where it computes what the processors and the log-probabilities do; else ``None``
    fused_temperature: float | None = None


def fused_sampling_temperature(processors: Any, temperature: float | None) -> float | None:
    """The one temperature that both draws (``processors``: none, or one ``TemperatureLogitsWarper``) and scores
    (``temperature``, the log-probabilities'; ``None`` or ``<= 0``: unscaled, or none kept) a call's tokens, or
    ``None`` where they differ or another processor (top-k, top-p, min-p) needs the sorted scores."""
    if len(processors) > 1 or any(type(p).__name__ != "TemperatureLogitsWarper" for p in processors):
        return None
    drawn = float(processors[0].temperature) if len(processors) else 1.0
    scored = drawn if temperature is None else float(temperature) if temperature > 0 else 1.0
    return drawn if scored == drawn else None


def _sample(cache: StaticKVCache, logits: torch.Tensor, rows: int, sampling: _Sampling, fused: bool = False) -> None:
    """Draw each of the first ``rows`` rows' token ``step`` from ``logits`` ``[rows, V]`` (the host loop's
    processors, draw and log-probability), record it, count it for the rows still going and mark the rows
    it ends (an end token, or the row's budget); it becomes the row's next ``token``. ``fused``: as one Triton
    kernel where the sampling allows it (:attr:`_Sampling.fused_temperature`). ``step`` moves on after
    (:func:`_advance`)."""
    if fused and sampling.fused_temperature is not None:
        triton_step.sample_step(
            logits[:rows], temperature=sampling.fused_temperature, do_sample=sampling.do_sample, step=cache.step,
            uniforms=cache.uniforms, eos=sampling.eos, budget=cache.budget, done=cache.done, count=cache.count,
            token=cache.token, tokens=cache.tokens, log_probs=cache.log_probs if sampling.temperature is not None
            else None)
        return
    scores = sampling.processors(cache.token[:rows, None], logits.to(dtype=torch.float32))
    if sampling.do_sample:
        uniforms = cache.uniforms.index_select(0, cache.step)[0, :rows]
        new = sample_categorical(torch.softmax(scores, dim=-1), uniforms, host_check=False)
    else:
        new = torch.argmax(scores, dim=-1)
    cache.tokens[:rows].index_copy_(1, cache.step, new[:, None])
    if sampling.temperature is not None:
        cache.log_probs[:rows].index_copy_(1, cache.step, token_log_probs(logits, new, sampling.temperature)[:, None])
    done = cache.done[:rows]
    cache.count[:rows] += (~done).long()
    done |= (new[:, None] == sampling.eos[None, :]).any(-1) | (cache.step + 1 >= cache.budget[:rows])
    cache.token[:rows] = new


def _advance(cache: StaticKVCache, rows: int, fused: bool = False) -> None:
    """A step's end: the first ``rows`` rows' ``position``, the ``cursor`` and the sampling's ``step`` each up by
    one (``fused``: in one Triton launch, :func:`~spader_pipeline.modeling.triton_step.advance`)."""
    if fused:
        triton_step.advance(cache.position, rows, cache.cursor, cache.step)
        return
    cache.position[:rows] += 1
    cache.cursor += 1
    cache.step += 1


def decoding_step(step: _Step, cache: StaticKVCache, rows: int, length: int, sampling: _Sampling, attention: str,
                  kernels: str) -> None:
    """One decoding step of the first ``rows`` rows over ``length`` positions, as a runner launches (and a graph
    captures) it: the forward (:meth:`_Step.forward`), the sampling, the advance."""
    fused = kernels == "triton"
    _sample(cache, step.forward(cache, rows, length, sampling.captured, attention, kernels), rows, sampling,
            fused=fused)
    _advance(cache, rows, fused)


def _cuda_graph(step: Callable[[], None], pool: Any, stream: Any) -> Any:
    """``step`` captured in a CUDA graph on ``stream`` (its intermediates in ``pool``, which every graph of a
    static cache shares: they replay one at a time, and nothing they leave in it is read after).

    Each decoder captures on a stream of its own: cuBLAS keeps one workspace per stream, allocated in the
    first capture's pool and read by every later graph captured on that stream, and a graph's destruction
    may free it (torch's ``clearCublasWorkspacesForStream``, pytorch#193402). On one shared stream, one
    decoder dropping its graphs (a larger cache, moved weights) would pull the workspace from under another
    decoder's graphs; on its own stream a decoder's graphs go together."""
    graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            step()
    except BaseException:
        torch.cuda.set_stream(current)  # a failed capture leaves torch.cuda.graph's stream current
        raise
    return graph


def _use_graphs(device: torch.device) -> bool:
    return static_cache.CUDA_GRAPHS and device.type == "cuda" and not _graphs_failed


class _CapturedStep:
    """A bucket's step: launched op by op the first time (the step of that window, which also loads its
    kernels), captured then, replayed after. Where the capture fails, op by op from then on."""

    def __init__(self, step: Callable[[], None], pool: Any, stream: Any, label: str) -> None:
        self.step, self.pool, self.stream, self.label, self.graph = step, pool, stream, label, None

    @property
    def ready(self) -> bool:
        return self.graph is not None

    def prepare(self) -> None:
        """The bucket's first step, eagerly, then its capture."""
        global _graphs_failed
        started = time.perf_counter()
        self.step()
        _STATS["eager_steps"] += 1
        try:
            self.graph = _cuda_graph(self.step, self.pool, self.stream)
        except Exception:  # noqa: BLE001 - a step that does not capture: op by op, said once
            _graphs_failed = True
            self.graph = False
            logger.warning("the decoding step at %s did not capture in a CUDA graph: decoding launches it op by op "
                           "from now on", self.label, exc_info=True)
            return
        seconds = time.perf_counter() - started
        _STATS["captures"] += 1
        _STATS["capture_seconds"] += seconds
        logger.info("captured the decoding step at %s in %.3f s (%d graphs, %.1f s in this process)", self.label,
                    seconds, _STATS["captures"], _STATS["capture_seconds"])

    def __call__(self) -> None:
        if self.graph:
            self.graph.replay()
            _STATS["replays"] += 1
        else:
            self.step()
            _STATS["eager_steps"] += 1


class _EagerStep:
    """A bucket's step launched op by op (the CPU, or graphs off)."""

    ready = True

    def __init__(self, step: Callable[[], None]) -> None:
        self.step = step

    def __call__(self) -> None:
        self.step()
        _STATS["eager_steps"] += 1


class _Decoder:
    """Per model and precision: the step, its static cache, its captured buckets, and the cache living in it."""

    def __init__(self, model: torch.nn.Module, precision: _Precision, device: torch.device) -> None:
        self.precision, self.device = precision, device
        self.step = _Step(model, precision, device)
        self.cache: StaticKVCache | None = None
        self.tenant: weakref.ref | None = None
        self.runners: dict[tuple, Any] = {}
        self.samplings: dict[tuple, _Sampling] = {}
        self.pool: Any = None
        self.capture_stream: Any = None  # made with the first capture (:func:`_cuda_graph` says why its own)

    def renew(self, model: torch.nn.Module) -> None:
        """A new step where the model's tensors moved (the graphs read the old ones), else fresh weights."""
        if _signature(model) != self.step.signature:
            self.step = _Step(model, self.precision, self.device)
            self.runners.clear()
            self.pool = None  # the graphs went: a fresh pool for the next ones, as a new cache has
        else:
            self.step.weights.refresh()

    def sampling(self, processors: Any, do_sample: bool, temperature: float | None, eos_ids: set[int],
                 captured: int | None) -> _Sampling:
        key = (tuple((type(p).__name__, tuple(sorted((k, repr(v)) for k, v in vars(p).items()))) for p in processors),
               do_sample, temperature, tuple(sorted(eos_ids)), captured)
        if key not in self.samplings:
            eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=self.device)
            self.samplings[key] = _Sampling(key, processors, do_sample, temperature, eos, captured,
                                            fused_sampling_temperature(processors, temperature))
        return self.samplings[key]

    def take(self, cache: GrowingKVCache, rows: int, length: int, steps: int, captured: int | None) -> StaticKVCache:
        """A static cache for ``rows`` rows, ``length`` positions, ``steps`` tokens (allocated anew where the
        current one is too small: its graphs go with it), with ``cache`` living in it: another cache living
        there moves out first."""
        width = self.step.hidden if captured is not None else None
        current = self.cache
        tenant = self.tenant() if self.tenant is not None else None
        if tenant is not None and tenant is not cache and current is not None:
            tenant.own_storage(current.pointers())
            _STATS["evictions"] += 1
        moved = current is None or not cache.layers[0].holds(current.keys[0][:rows])
        if current is None or not current.fits(rows=rows, length=length, steps=steps, states_width=width):
            step = self.step
            self.pool = None
            self.runners.clear()
            self.cache = StaticKVCache(
                layers=step.layers_count, kv_heads=step.kv_heads, head_dim=step.head_dim,
                rows=max(row_bucket(rows), current.rows if current else 0),
                length=max(allocation_length(length), current.length if current else 0),
                steps=max(-(-steps // 64) * 64, current.steps if current else 0), kv_dtype=self.precision.kv,
                device=self.device, states_width=width if width is not None else (current.states_width if current else None),
                states_dtype=self.precision.residual, allocate_layers=False)
            for index in range(step.layers_count):  # a layer at a time: the old buffers go as the new come
                self.cache.allocate_layer(index)
                cache.layers[index].move_storage(self.cache.keys[index][:rows], self.cache.values[index][:rows])
                if current is not None:
                    current.keys[index] = current.values[index] = None
            moved = True
            _STATS["allocations"] += 1
            _STATS["allocated_bytes"] = self.cache.nbytes
            logger.info("static decoding cache: %d rows x %d positions, %.2f GB", self.cache.rows, self.cache.length,
                        self.cache.nbytes / 1e9)
        static = self.cache
        _STATS["moved_in"] += moved
        cache.move_storage([k[:rows] for k in static.keys], [v[:rows] for v in static.values],
                           static.states[:rows] if captured is not None else None)
        self.tenant = weakref.ref(cache)
        return static

    def attention(self) -> str:
        """The step's attention under the switches: ``cpu`` (the CPU's decoding attention under autocast),
        ``triton`` where chosen and the model's heads fit the kernel, else ``sdpa``."""
        if self.precision.attention is None:
            return "cpu"
        attention = static_cache.static_attention_name()
        if attention == "triton" and not triton_fits(self.step.heads // self.step.kv_heads, self.step.head_dim):
            return "sdpa"  # a shape the kernel does not take (the tests' tiny models' heads of 8)
        return attention

    def step_length(self, cursor: int) -> int:
        """The positions a step writing at ``cursor`` attends over, its graph's length: a length bucket for SDPA
        (it reads the whole view) and the CPU's attention; with the Triton attention, which reads each row's
        positions from its first to the cursor whatever the view, the whole allocation, so that one graph per
        row bucket serves every length the allocation holds (fewer captures)."""
        if self.attention() == "triton":
            return self.cache.length
        return length_bucket(cursor + 1, self.cache.length)

    def runner(self, rows: int, length: int, sampling: _Sampling) -> Any:
        """The step at ``rows`` x ``length`` for ``sampling``, captured once where graphs are on."""
        graphs = _use_graphs(self.device)
        attention = self.attention()
        kernels = static_cache.static_kernels_name() if self.step.fusable else "aten"
        key = (rows, length, sampling.key, attention, kernels, graphs)
        if key not in self.runners:
            _STATS["buckets"] += 1
            cache, step = self.cache, self.step
            step.rotary_tables(cache.length)  # before a capture: its kernels are not the step's
            one_step = functools.partial(decoding_step, step, cache, rows, length, sampling, attention, kernels)

            if graphs:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                if self.capture_stream is None:
                    self.capture_stream = torch.cuda.Stream(self.device)
                self.runners[key] = _CapturedStep(one_step, self.pool, self.capture_stream,
                                                  f"{rows} rows x {length} positions")
            else:
                self.runners[key] = _EagerStep(one_step)
        return self.runners[key]


def static_decoder(model: Any, cache: Any, processors: Any) -> _Decoder | None:
    """The static step's decoder for ``model`` decoding into ``cache`` with ``processors`` (the weights
    refreshed), or ``None`` where it does not apply: the switches (:mod:`~spader_pipeline.modeling.static_cache`),
    a :class:`GrowingKVCache` holding every layer, processors of :data:`GRAPH_PROCESSORS`, no gradients, a
    supported decoder without biases or a dynamic rotary embedding, no forward hook but the boundary
    capture's, and a precision :func:`_precision` knows."""
    first = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    if first is None or not static_cache.static_decode_selected(first.device) or torch.is_grad_enabled():
        return None  # the CPU's default: nothing more to look at
    linears = decoder_linears(model)
    if linears is None:
        return None
    device = linears[0].weight.device
    if not isinstance(cache, GrowingKVCache) or not cache.layers or any(
            layer._key_buffer is None for layer in cache.layers):
        return None
    if any(type(p).__name__ not in GRAPH_PROCESSORS for p in processors):
        return None
    if any(m.bias is not None for m in linears) or getattr(model.model.rotary_emb, "rope_type", "default") in DYNAMIC_ROPE:
        return None
    if _has_foreign_hooks(model):
        return None
    precision = _precision(model, linears, device)
    if precision is None:
        return None
    decoders = _DECODERS.setdefault(model, {})
    decoder = decoders.get(precision)
    if decoder is None:
        decoder = decoders[precision] = _Decoder(model, precision, device)
    else:
        decoder.renew(model)
        decoder.step.products = _host_products(model, device)
    return decoder


def release_static_decoders(model: torch.nn.Module) -> bool:
    """Let go of ``model``'s static decoders: their static caches, captured graphs and weight copies (a
    rollout server going to sleep frees what the trainer needs; moving the model's weights off the device
    would make them stale anyway). The next decoding call builds them again. Whether there were any."""
    return _DECODERS.pop(model, None) is not None


@contextlib.contextmanager
def _no_host_reads(device: torch.device) -> Iterator[None]:
    """While active (with :data:`SYNC_CHECK`, on CUDA), an operation that waits for the device raises."""
    if not (SYNC_CHECK and device.type == "cuda"):
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _run_steps(decoder: _Decoder, static: StaticKVCache, logits: torch.Tensor, sampling: _Sampling, batch: int,
               width: int, longest: int, order: list[int]) -> None:
    """The first token from the prefill's ``logits``, then windows of steps until every row ended, the ended
    rows moved behind the going ones (``order``: the cache row each row held before, kept along)."""
    _sample(static, logits, batch, sampling)  # the first token, from the prefill's logits
    static.step += 1
    rows, sampled = row_bucket(batch), 1
    while sampled < longest:
        done = static.done[:rows].tolist()  # the one read from the device in a window of steps
        going = rows - sum(done)
        if going == 0:
            break
        if row_bucket(going) < rows:  # the going rows fit a smaller bucket: ended rows behind them
            holes, fillers = retire_rows([row for row in range(rows) if done[row]], rows)
            static.compact(holes, fillers, width + sampled - 1)
            for hole, filler in zip(holes, fillers, strict=True):
                order[hole], order[filler] = order[filler], order[hole]
            rows = row_bucket(going)
        cursor = width + sampled - 1
        length = decoder.step_length(cursor)
        window = min(static_cache.SYNC_EVERY, longest - sampled, length - cursor)
        runner = decoder.runner(rows, length, sampling)
        first = 0
        if not runner.ready:
            runner.prepare()
            first = 1
        with _no_host_reads(decoder.device):
            for _ in range(window - first):
                runner()
        sampled += window


@dataclass
class StaticOutcome:
    """What :func:`decode_static` sampled, per cache row after the call: ``tokens`` (each ended by an end
    token or its budget), ``log_probs`` (``None`` unless asked), ``rows`` (the cache row each held before
    the call: ended rows move behind the going ones), ``steps`` (sampling steps: the longest row's tokens)."""

    tokens: list[list[int]]
    log_probs: list[list[float]] | None
    rows: list[int]
    steps: int


def decode_static(model: Any, decoder: _Decoder, cache: GrowingKVCache, logits: torch.Tensor, mask: torch.Tensor,
                  positions: torch.Tensor, budgets: list[int], draw_rows: list[int], *, eos_ids: set[int],
                  processors: Any, do_sample: bool, log_prob_temperature: float | None) -> StaticOutcome:
    """The decoding steps of :func:`~spader_pipeline.modeling.decode.decode_batch` after its prefill, on the
    static step.

    ``cache`` holds the prefill (``mask`` ``[B, W]``: its real positions per cache row), ``logits`` ``[B, V]``
    the prefill's last position's, ``positions`` long ``[B]`` each row's next logical position, ``budgets``
    its most tokens, ``draw_rows`` the input row it holds (a row draws the uniform numbers of its input row,
    as the host loop: ``torch.rand(B)`` per step, for all ``B`` input rows). Afterwards ``cache`` is ``W +
    steps - 1`` positions long (the last sampled token is not fed), its rows permuted as
    :attr:`StaticOutcome.rows` says, and the global generator where the host loop would leave it.
    """
    batch, width = mask.shape
    longest = max(budgets)
    captured = CAPTURED_BLOCK.get(model, (None, None))[0] if cache.states is not None else None
    static = decoder.take(cache, batch, width + longest - 1, longest, captured)
    sampling = decoder.sampling(processors, do_sample, log_prob_temperature, eos_ids, captured)
    uniforms = rng = None
    order = list(range(batch))
    if do_sample:  # the whole turn's draws now, in the order the host loop draws them step by step
        rng = torch.get_rng_state()
        uniforms = torch.rand(longest, batch)[:, torch.tensor(draw_rows)]
    static.begin(rows=batch, width=width, mask=mask, positions=positions, budgets=budgets, uniforms=uniforms)
    # the step casts what it casts itself (autocast's casts would be the same, and a capture keeps none of them)
    with torch.autocast(decoder.device.type, enabled=False):
        _run_steps(decoder, static, logits, sampling, batch, width, longest, order)
    counts = static.count[:batch].tolist()
    steps = max(counts)
    tokens = [row[:count] for row, count in zip(static.tokens[:batch, :steps].tolist(), counts, strict=True)]
    log_probs = None
    if log_prob_temperature is not None:
        log_probs = [row[:count] for row, count in zip(static.log_probs[:batch, :steps].tolist(), counts, strict=True)]
    if rng is not None:  # the generator where the host loop leaves it: steps x B numbers drawn
        torch.set_rng_state(rng)
        torch.rand(steps, batch)
    cache.set_active_rows(None)
    if steps > 1:
        cache.reserve(steps - 1)
        if captured is not None:
            cache.states.reserve(steps - 1)
    return StaticOutcome(tokens=tokens, log_probs=log_probs, rows=order, steps=steps)
