"""Grouped-query attention on CPU without copying the KV cache.

transformers' ``sdpa`` attention expands the key/value heads of a grouped-query model (``repeat_kv``)
whenever an attention mask is given — always, for a left-padded batch — so every decoding step
copies the whole KV cache ``num_heads / num_kv_heads`` times. ``torch.nn.functional.
scaled_dot_product_attention(..., enable_gqa=True)`` (torch ≥ 2.5) reads the shared heads in place:
on the 2-core CI machine one decoding step of SmolLM2's attention (batch 32, 800 cached tokens, 9
query / 3 key-value heads) took 32 ms instead of 300 ms, same output. Registered through
transformers' public ``AttentionInterface`` as ``sdpa_gqa`` (masks as for ``sdpa``) and switched on
per loaded model; it is a runtime setting, never written to a saved ``config.json``.
"""

from __future__ import annotations

import contextlib

import torch

from spader_pipeline.modeling.decode_attention import decode_attention

NAME = "sdpa_gqa"


def sdpa_gqa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):
    """``sdpa`` attention with ``enable_gqa`` (shapes as transformers' ``sdpa_attention_forward``:
    query ``[B, H, T, D]``, key/value ``[B, H_kv, S, D]``; returns ``[B, T, H, D]``, ``None``)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    decoding_in_fp32 = _cpu_autocast_decoding(query)
    if (decoding_in_fp32 and key.dtype == torch.bfloat16 and dropout == 0.0
            and (attention_mask is None or attention_mask.dtype == torch.bool)):  # a bf16 cache: decode_attention
        mask = None if attention_mask is None else attention_mask[:, 0, -1, :]  # the one query position's row
        out = decode_attention(query.float(), key, value, mask, scaling if scaling is not None else query.shape[-1] ** -0.5)
        return out.transpose(1, 2).contiguous(), None
    with torch.autocast("cpu", enabled=False) if decoding_in_fp32 else contextlib.nullcontext():
        if decoding_in_fp32:
            query, key, value = query.float(), key.float(), value.float()
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
            enable_gqa=key.shape[1] != query.shape[1],
        )
    return out.transpose(1, 2).contiguous(), None


def _cpu_autocast_decoding(query: torch.Tensor) -> bool:
    """Whether this is a decoding step (one query position) on CPU under autocast: its attention then
    runs in fp32.

    Under CPU bf16 autocast, SDPA casts the queries and the whole KV cache to bf16 and runs its bf16
    CPU kernel, which is slow for one query position: 7.3 ms per SmolLM2 layer for 16 rows over 700
    cached positions, against 0.55 ms in fp32 (docs/performance.md). Prefill and the update (many
    query positions) run at the same speed in both, so they keep autocast.
    """
    return query.device.type == "cpu" and query.shape[2] == 1 and torch.is_autocast_enabled("cpu")


def use_gqa_attention(model) -> bool:
    """Switch ``model`` to :data:`NAME` when it is a grouped-query model currently on ``sdpa``."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or kv_heads == heads or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_gqa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
