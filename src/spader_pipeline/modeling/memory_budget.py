"""Batch sizes from a memory budget for the KV caches, not a row count.

A batch of ``B`` trajectories keeps a KV cache of ``B × tokens × kv_bytes_per_token`` while it is
generated (the cache is reused between turns). An evaluation of 100 six-turn trajectories in one
batch therefore needs several GB for the caches alone (issue 34: ``make compare`` peaked at 21.8 GB).
:func:`rows_within_budget` caps the batch at the rows whose longest possible cache fits the budget;
the rows are the same trajectories, cut into more batches, so the outputs do not change.
"""

from __future__ import annotations

from typing import Any

#: Peak cache memory per cached position, in units of the keys/values themselves: a
#: :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache` keeps up to half its length in spare
#: room and, when it grows, holds the old and the new buffer for a moment.
GROWTH = 2.5


def kv_bytes_per_token(config: Any, dtype_bytes: int = 4) -> int:
    """Bytes of keys and values one token takes in the cache of a transformers decoder ``config``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def rows_within_budget(config: Any, tokens_per_row: int, budget_mb: float, *, limit: int,
                       dtype_bytes: int = 4) -> int:
    """The most rows (at most ``limit``, at least 1) whose caches of ``tokens_per_row`` positions fit
    ``budget_mb`` MiB at their peak (:data:`GROWTH`)."""
    if budget_mb <= 0 or tokens_per_row <= 0:
        raise ValueError(f"kv_cache_budget_mb={budget_mb} and tokens per row={tokens_per_row} must be > 0")
    per_row = kv_bytes_per_token(config, dtype_bytes) * tokens_per_row * GROWTH
    return max(1, min(limit, int(budget_mb * 2**20 // per_row)))
