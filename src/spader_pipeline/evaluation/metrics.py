"""Evaluation metrics of multi-answer search agents (definitions: ``docs/metrics.md``).

Correctness comes from :mod:`spader_pipeline.algorithms.matching` — the same alias-aware scoring
the training rewards use. Search counts come from the executed tool calls of the assistant turns
only, never the prompt's example call.

* :func:`sample_metrics` — every per-sample metric of one trajectory;
* :func:`entity_corpus_frequency` — in how many corpus passages each gold entity occurs (for the
  long-tail buckets);
* :func:`aggregate` — the dataset-level table row (means, ratios of sums, long-tail recall).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from spader_pipeline.algorithms.entity_search import EntityMatcher
from spader_pipeline.algorithms.matching import normalize_ground_truth, score_answers

RECALL_AT = (5, 10, 20, 50)
DEFAULT_LONG_TAIL_EDGES = (1, 2, 5, 20)

__all__ = [
    "DEFAULT_LONG_TAIL_EDGES",
    "RECALL_AT",
    "aggregate",
    "bucket_labels",
    "entity_corpus_frequency",
    "sample_metrics",
]


def sample_metrics(
    *,
    predicted: Sequence[str] | None,
    ground_truth: Sequence[Sequence[str]],
    assistant_turns: Sequence[str] = (),
    num_searches: int = 0,
    num_queries: int = 0,
    num_invalid_turns: int = 0,
    retrieved_texts: Sequence[str] = (),
    corpus_frequency: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Per-sample metrics. ``predicted is None`` means no valid ``<answer>`` (a format error).

    Args:
        predicted: the final answer list (raw strings) or ``None``.
        ground_truth: ``[[alias, ...], ...]`` per gold entity.
        assistant_turns: the assistant turn texts (only their count is used here).
        num_searches: tool calls executed (assistant turns only).
        num_queries: queries in those calls.
        num_invalid_turns: turns that received a corrective observation.
        retrieved_texts: every retrieved document text of the trajectory (no query echoes).
        corpus_frequency: per gold entity (normalised order), passages of the corpus that contain it.
    """
    gt = normalize_ground_truth(ground_truth)
    score = score_answers(list(predicted or ()), gt)
    entity_score = score_answers(list(predicted or ()), gt, precision_mode="entity")
    seen = EntityMatcher(gt).found_in(list(retrieved_texts)).any(axis=0) if len(gt) else np.zeros(0, bool)
    matched = np.zeros(len(gt), dtype=bool)
    matched[list(score.matched)] = True
    num_seen = int(seen.sum())
    out: dict[str, Any] = {
        "format_error": float(predicted is None),
        "precision": score.precision,
        "precision_entity": entity_score.precision,
        "recall": score.recall,
        "f1": score.f1,
        "exact_match": score.exact_match,
        **{f"recall_at_{k}": score.recall_at(k) for k in RECALL_AT},
        "num_gt": len(gt),
        "num_answers": len(predicted) if predicted is not None else 0,
        "num_predicted": score.num_predicted,
        "num_correct_answers": score.num_correct,
        "num_matched": len(score.matched),
        "num_turns": len(assistant_turns),
        "num_searches": int(num_searches),
        "num_queries": int(num_queries),
        "num_invalid_turns": int(num_invalid_turns),
        "searches_per_correct": (num_searches / len(score.matched)) if score.matched else math.nan,
        "num_seen": num_seen,
        "num_seen_and_matched": int((matched & seen).sum()),
        "seen_recall": num_seen / len(gt) if len(gt) else 0.0,
        "answered_given_seen": float((matched & seen).sum() / num_seen) if num_seen else math.nan,
        "matched_entities": [bool(x) for x in matched],
        "canonical_entities": list(gt.canonical),
    }
    if corpus_frequency is not None:
        out["corpus_frequency"] = [int(x) for x in corpus_frequency]
    return out


def entity_corpus_frequency(
    ground_truths: Sequence[Sequence[Sequence[str]]],
    corpus_texts: Iterable[str],
    *,
    chunk_size: int = 4096,
) -> list[list[int]]:
    """For each sample and each of its gold entities (normalised order), the passages that mention it.

    One Aho-Corasick matcher over the union of all entities scans the corpus once, in chunks.
    """
    union: dict[tuple[str, ...], int] = {}
    per_sample: list[list[int]] = []
    for gt in ground_truths:
        ids = []
        for aliases in normalize_ground_truth(gt).aliases:
            ids.append(union.setdefault(aliases, len(union)))
        per_sample.append(ids)
    counts = np.zeros(len(union), dtype=np.int64)
    if union:
        matcher = EntityMatcher([list(a) for a in union])
        # normalize_ground_truth keeps distinct alias sets in order, so matcher columns == union ids.
        assert matcher.num_entities == len(union)
        chunk: list[str] = []
        for text in corpus_texts:
            chunk.append(text)
            if len(chunk) >= chunk_size:
                counts += matcher.found_in(chunk).sum(axis=0)
                chunk = []
        if chunk:
            counts += matcher.found_in(chunk).sum(axis=0)
    return [[int(counts[i]) for i in ids] for ids in per_sample]


def bucket_labels(edges: Sequence[int] = DEFAULT_LONG_TAIL_EDGES) -> list[str]:
    """Labels of the buckets ``[0, e0), [e0, e1), …, [e_last, ∞)`` of corpus frequency."""
    bounds = [0, *edges]
    labels = []
    for lo, hi in zip(bounds, [*edges, None], strict=True):
        if hi is None:
            labels.append(f"{lo}_or_more")  # MLflow metric keys allow no "+"
        elif hi - lo == 1:
            labels.append(str(lo))
        else:
            labels.append(f"{lo}-{hi - 1}")
    return labels


def _nanmean(values: Iterable[float]) -> float:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    arr = arr[~np.isnan(arr)]
    return float(arr.mean()) if arr.size else math.nan


_MEAN_KEYS = (
    "precision",
    "precision_entity",
    "recall",
    "f1",
    "exact_match",
    *(f"recall_at_{k}" for k in RECALL_AT),
    "format_error",
    "num_turns",
    "num_searches",
    "num_queries",
    "num_invalid_turns",
    "num_answers",
    "num_predicted",
    "num_gt",
    "num_seen",
    "num_matched",
    "seen_recall",
)


def aggregate(
    records: Sequence[Mapping[str, Any]],
    *,
    num_failed: int = 0,
    long_tail_edges: Sequence[int] = DEFAULT_LONG_TAIL_EDGES,
) -> dict[str, float]:
    """Dataset-level metrics from per-sample records (successful samples only; failures counted).

    Means over samples for per-sample metrics; ratios of sums for ``searches_per_correct_entity``,
    ``answered_given_seen`` (micro) and the long-tail recalls ``long_tail_recall/<bucket>``.
    """
    n = len(records)
    out: dict[str, float] = {
        "num_samples": float(n),
        "num_failed": float(num_failed),
        "failure_rate": num_failed / (n + num_failed) if n + num_failed else 0.0,
    }
    for key in _MEAN_KEYS:
        out[key] = _nanmean(r.get(key) for r in records)
    searches = sum(r.get("num_searches", 0) for r in records)
    correct = sum(r.get("num_matched", 0) for r in records)
    out["searches_per_correct_entity"] = searches / correct if correct else math.nan
    turns = sum(r.get("num_turns", 0) for r in records)
    out["invalid_turn_rate"] = (
        sum(r.get("num_invalid_turns", 0) for r in records) / turns if turns else math.nan
    )
    seen_total = sum(r.get("num_seen", 0) for r in records)
    seen_and_matched = sum(r.get("num_seen_and_matched", 0) for r in records)
    out["answered_given_seen"] = seen_and_matched / seen_total if seen_total else math.nan
    labels = bucket_labels(long_tail_edges)
    hits = np.zeros(len(labels))
    totals = np.zeros(len(labels))
    for r in records:
        freqs = r.get("corpus_frequency")
        matched = r.get("matched_entities")
        if freqs is None or matched is None:
            continue
        buckets = np.searchsorted(
            np.asarray(long_tail_edges), np.asarray(freqs, dtype=np.int64), side="right"
        )
        np.add.at(totals, buckets, 1)
        np.add.at(hits, buckets, np.asarray(matched, dtype=float))
    for label, h, t in zip(labels, hits, totals, strict=True):
        out[f"long_tail_recall/{label}"] = float(h / t) if t else math.nan
        out[f"long_tail_entities/{label}"] = float(t)
    return out
