"""Decoding attention over a bf16 key/value cache on the CPU: one query position per row, grouped heads.

At 16-64 decoding rows a step of SmolLM2 is mostly attention: every row reads its whole cache in every
layer. Decoding attends in fp32 (:mod:`~spader_pipeline.modeling.attention`: SDPA's bf16 CPU kernel is
several times slower for one query position), so the cache was fp32 too, twice the bytes of
llama.cpp's f16 cache, and torch has no fast bf16 kernel for this shape (SDPA and batched products in
bf16 both lose to fp32 SDPA here). The native attention (``spader_native::decode_attention`` in
``native/decode_step.cpp``, :mod:`~spader_pipeline.modeling.native_step`) reads each bf16 key and value
once per key/value head, widened in registers, for the head's whole group of query heads: the scores
over the head dimension, ATen's softmax over the positions, the values weighted by it. The arithmetic
is fp32.

What changes: the keys are cached in bf16 (the values already are bf16, the projection's output), so
a decoding step's attention reads keys rounded as the prefill's attention under autocast already reads
them. Tokens and log-probabilities move within the bound ``tests/modeling/test_modeling_decode_attention.py``
states; the trainer recomputes the log-probabilities it trains on in any case.

Where it runs: the keys are rounded to bf16 in the cache wherever :data:`BF16_CACHE` is on
(:func:`bf16_key_cache`), whether the native extension builds or not, so that the decoding path does
not change which tokens a seed samples. Where the extension builds and its attention checks out against
fp32 SDPA (:func:`~spader_pipeline.modeling.native_step.native_available`) they are stored in bf16 and
the native attention reads them. Elsewhere (no C++ compiler) they are stored widened to fp32, once, and
fp32 SDPA attends over them (:func:`~spader_pipeline.modeling.native_step.sdpa_decode_reference`, the
reference the native attention is checked against): the same keys and values, the same arithmetic up
to the order of the fp32 sums, without widening the whole cache at every step.
"""

from __future__ import annotations

import torch

from spader_pipeline.modeling.native_step import env_choice, native_available, sdpa_decode_reference

__all__ = ["BF16_CACHE", "KV_CACHE_ENV", "bf16_decode_attention_available", "bf16_key_cache", "decode_attention"]

#: the variable that picks the key cache of every process started with it: ``bf16`` (the default) or
#: ``fp32`` (SDPA over fp32 keys: within the bound of tests/modeling/test_modeling_decode_attention.py)
KV_CACHE_ENV = "SPADER_KV_CACHE"
#: cache keys rounded to bf16 on the CPU and attend with the native attention where it is available, fp32
#: SDPA over them widened elsewhere (benchmarks switch it off to time the fp32 cache in the same process)
BF16_CACHE = env_choice(KV_CACHE_ENV, {"bf16": True, "fp32": False}, "bf16")


def bf16_key_cache() -> bool:
    """Whether the CPU's decoding steps cache their keys rounded to bf16 (:data:`BF16_CACHE`), with or
    without the native attention (stored in bf16 for it, in fp32 for SDPA)."""
    return BF16_CACHE


def bf16_decode_attention_available() -> bool:
    """Whether the CPU's decoding steps cache bf16 keys and attend with the native attention:
    :data:`BF16_CACHE` and the extension built and checked out (:func:`~spader_pipeline.modeling.
    native_step.native_available`)."""
    return BF16_CACHE and native_available()


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, *, native: bool | None = None) -> torch.Tensor:
    """Attention of one query position per row over the cache, in fp32.

    ``query`` fp32 ``[n, H, 1, D]``; ``keys``/``values`` ``[n, H_kv, L, D]`` (``H`` a multiple of
    ``H_kv``; bf16 or fp32); ``mask`` bool ``[n, L]`` (True: attend) or ``None``. Returns fp32
    ``[n, H, 1, D]``. ``native``: the native attention (default: where the cache is bf16 and it is
    available, without gradients: it has no backward), else fp32 SDPA on the widened cache.
    """
    if native is None:
        native = keys.dtype == torch.bfloat16 and not torch.is_grad_enabled() and bf16_decode_attention_available()
    if not native:
        return sdpa_decode_reference(query, keys, values, mask, scale)
    return torch.ops.spader_native.decode_attention(query[:, :, 0], keys, values, mask, scale)[:, :, None]
