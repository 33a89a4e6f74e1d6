"""Decoding attention over a bf16 key/value cache on the CPU: one query position per row, grouped heads.

At 16-64 decoding rows a step of SmolLM2 is mostly attention: every row reads its whole cache in every
layer. Decoding attends in fp32 (:mod:`~spader_pipeline.modeling.attention`: SDPA's bf16 CPU kernel is
several times slower for one query position), so the cache was fp32 too, twice the bytes of
llama.cpp's f16 cache, and torch has no fast bf16 kernel for this shape (SDPA and batched products in
bf16 both lose to fp32 SDPA here). :func:`decode_attention` writes the attention as two reductions,
``scores = q·k`` over the head dimension and ``out = p·v`` over the positions, each query-head group
reading its key/value head once; ``torch.compile`` (Inductor) turns them into vectorised C++ loops that
read each bf16 key and value once and widen them in registers. The whole step is fp32 arithmetic.

What changes: the keys are cached in bf16 (the values already are bf16, the projection's output), so
a decoding step's attention reads keys rounded as the prefill's attention under autocast already reads
them. Tokens and log-probabilities move within the bound ``tests/modeling/test_modeling_decode_attention.py``
states; the trainer recomputes the log-probabilities it trains on in any case.

Where it runs: :func:`bf16_decode_attention_available` compiles the kernel once per process (dynamic
shapes: one graph for every row count and length; Inductor's on-disk cache serves later processes) and
compares it with fp32 SDPA on a small case. Where compiling fails (no C++ compiler) or the result
differs, or :data:`BF16_CACHE` is off, the cache stays fp32 and decoding attends with SDPA as before.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from spader_pipeline.modeling.native_step import native_available

__all__ = ["BF16_CACHE", "bf16_decode_attention_available", "decode_attention"]

logger = logging.getLogger(__name__)

#: cache keys in bf16 and attend with the compiled kernel where it is available (benchmarks switch it
#: off to time the fp32 cache in the same process)
BF16_CACHE = True
#: the compiled kernel's largest difference from fp32 SDPA on the same (bf16) keys and values allowed
#: by the availability check: reassociation of fp32 sums only
_CHECK_TOLERANCE = 1e-4


def _grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """``query`` fp32 ``[B, G, D]`` (already scaled; ``B`` = rows x key/value heads, ``G`` query heads
    per key/value head), ``keys``/``values`` ``[B, L, D]`` (any float dtype, each read once), ``mask``
    bool ``[B, L]`` (True: attend) or ``None`` (every position) → fp32 ``[B, G, D]``. No dimension is
    1 in practice (``B`` ≥ the key/value heads), so one dynamic-shape graph serves every row count."""
    scores = (query[:, :, None, :] * keys[:, None, :, :].float()).sum(-1)  # [B, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights[..., None] * values[:, None, :, :].float()).sum(-2)


@functools.lru_cache(maxsize=1)
def _compiled():
    """The kernel, compiled on first use: one graph with a mask, one without (a quarter faster where no
    row is padded: no mask to read), each on its first call."""
    return torch.compile(_grouped_attention, dynamic=True, fullgraph=True)


def _reference(query, keys, values, mask, scale):
    """fp32 SDPA (``query`` ``[n, H, 1, D]``, ``mask`` bool ``[n, L]`` or ``None``)."""
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(
            query, keys.float(), values.float(), attn_mask=None if mask is None else mask[:, None, None, :],
            scale=scale, enable_gqa=keys.shape[1] != query.shape[1])


def _compiled_matches_sdpa(masked: bool) -> bool:
    """Run the compiled kernel (with a mask or without) and check it against fp32 SDPA on bf16 inputs;
    ``False`` where it fails to compile or differs. The first call has decoding's size (Inductor decides
    from it whether the loops run on several threads), and no two sizes are alike (a dynamic graph, not
    one that takes equal sizes for equal)."""
    generator = torch.Generator().manual_seed(0)
    try:
        for rows, length in ((17, 513), (5, 7)):
            query = torch.randn(rows, 6, 1, 16, generator=generator)
            keys = torch.randn(rows, 3, length + 5, 16, generator=generator).to(torch.bfloat16)[:, :, :length]
            values = torch.randn(rows, 3, length + 5, 16, generator=generator).to(torch.bfloat16)[:, :, :length]
            mask = None
            if masked:
                mask = torch.ones(rows, length, dtype=torch.bool)
                mask[-1, : length // 3] = False
            with torch.no_grad():
                got = _compiled_attention(query, keys, values, mask, 0.25)
            if (got - _reference(query, keys, values, mask, 0.25)).abs().max().item() > _CHECK_TOLERANCE:
                logger.info("the compiled decoding attention (mask: %s) differs from SDPA here", masked)
                return False
    except Exception as error:  # noqa: BLE001 - any compile failure (no compiler, an Inductor bug)
        logger.info("the decoding attention (mask: %s) did not compile here (%s)", masked, type(error).__name__)
        return False
    return True


@functools.lru_cache(maxsize=1)
def _kernel_works() -> bool:
    """The masked graph compiled and checked (once per process): where it is not, the cache stays fp32."""
    return _compiled_matches_sdpa(masked=True)


@functools.lru_cache(maxsize=1)
def _unmasked_graph_works() -> bool:
    """The graph without a mask, compiled and checked on its first use; where it is not, unpadded rows go
    through the masked graph."""
    return _compiled_matches_sdpa(masked=False)


def bf16_decode_attention_available() -> bool:
    """Whether the CPU's decoding steps cache bf16 keys and attend with a kernel that reads them:
    :data:`BF16_CACHE`, and the native attention (:mod:`~spader_pipeline.modeling.native_step`) or
    else the compiled kernel built and checked out in this process."""
    return BF16_CACHE and (native_available() or _kernel_works())


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, *, compiled: bool | None = None) -> torch.Tensor:
    """Attention of one query position per row over the cache, in fp32.

    ``query`` fp32 ``[n, H, 1, D]``; ``keys``/``values`` ``[n, H_kv, L, D]`` (``H`` a multiple of
    ``H_kv``; bf16 or fp32); ``mask`` bool ``[n, L]`` (True: attend) or ``None``. Returns fp32
    ``[n, H, 1, D]``. ``compiled``: the compiled kernel (default: where the cache is bf16 and the
    kernel is available, without gradients: the kernel is compiled for inference), else fp32 SDPA on
    the widened cache.
    """
    if compiled is None:
        compiled = (keys.dtype == torch.bfloat16 and not torch.is_grad_enabled()
                    and bf16_decode_attention_available())
    if not compiled:
        return _reference(query, keys, values, mask, scale)
    if native_available():
        return torch.ops.spader_native.decode_attention(query[:, :, 0], keys, values, mask, scale)[:, :, None]
    if mask is None and not _unmasked_graph_works():
        mask = torch.ones(query.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
    return _compiled_attention(query, keys, values, mask, scale)


def _compiled_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """:func:`decode_attention`'s shapes through the compiled :func:`_grouped_attention`: rows and
    key/value heads flattened into one dimension, the query scaled, the mask repeated per head."""
    rows, heads, _, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    flat = rows * kv_heads
    if mask is not None:
        mask = mask[:, None, :].expand(rows, kv_heads, length).reshape(flat, length).contiguous()
    with torch.autocast("cpu", enabled=False):
        scaled = query.reshape(flat, heads // kv_heads, dim) * scale  # a new tensor: no base of n rows to guard on
        out = _compiled()(scaled, keys.reshape(flat, length, dim), values.reshape(flat, length, dim), mask)
    return out.reshape(rows, heads, 1, dim)
