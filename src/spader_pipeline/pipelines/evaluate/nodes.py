"""Thin nodes around :mod:`spader_pipeline.evaluation`: pick the datasets, count entity frequencies,
evaluate every model × dataset (:func:`spader_pipeline.evaluation.suite.evaluate_models`) and log
each evaluation as an MLflow run (:func:`spader_pipeline.evaluation.mlflow_runs.log_evaluation`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.child_process import runs_child_processes
from spader_pipeline.data.schema import frame_records
from spader_pipeline.evaluation.config import EvaluationConfig
from spader_pipeline.evaluation.metrics import entity_corpus_frequency
from spader_pipeline.evaluation.mlflow_runs import log_evaluation
from spader_pipeline.evaluation.plots import comparison_figure
from spader_pipeline.evaluation.suite import EvaluationResult, evaluate_manifests, records_frame

logger = logging.getLogger(__name__)

#: Columns of the comparison table, first, in this order.
TABLE_HEAD = ["model", "dataset", "num_samples", "num_failed", "precision", "recall", "f1", "exact_match"]


def select_eval_sets(
    eval_sets: Mapping[str, Callable[[], pd.DataFrame]], params: Mapping[str, Any]
) -> dict[str, list[dict]]:
    """The configured evaluation sets that exist: partitions of ``eval_sets`` named in
    ``params.datasets`` plus ``params.extra_files`` (name → jsonl path), each capped at ``max_samples``."""
    selected: dict[str, list[dict]] = {}
    for name in params.get("datasets") or []:
        if name not in eval_sets:
            logger.info("evaluation set %s not present (available: %s); skipped", name, sorted(eval_sets))
            continue
        selected[name] = frame_records(eval_sets[name]())
    for name, path in (params.get("extra_files") or {}).items():
        if not Path(path).is_file():
            logger.info("evaluation file %s (%s) not found; skipped", name, path)
            continue
        selected[name] = frame_records(pd.read_json(path, lines=True, dtype={"id": str}))
    limit = params.get("max_samples")
    if limit:
        selected = {k: v[: int(limit)] for k, v in selected.items()}
    for name, rows in selected.items():
        logger.info("evaluation set %s: %d questions", name, len(rows))
    return selected


def count_entity_frequencies(
    selected: Mapping[str, list[dict]], corpus: pd.DataFrame, params: Mapping[str, Any]
) -> dict[str, dict[str, list[int]]]:
    """Per dataset and sample id, in how many corpus passages each gold entity occurs (long-tail buckets)."""
    if not params.get("long_tail", {}).get("enabled", True) or not selected:
        return {}
    texts = (
        corpus["title"].fillna("").astype(str) + "\n" + corpus["contents"].fillna("").astype(str)
    ).tolist()
    out: dict[str, dict[str, list[int]]] = {}
    for name, rows in selected.items():
        freqs = entity_corpus_frequency([r["ground_truth"] for r in rows], texts)
        out[name] = {r["id"]: f for r, f in zip(rows, freqs, strict=True)}
    return out


@runs_child_processes
def run_evaluations(
    selected: Mapping[str, list[dict]],
    frequencies: Mapping[str, Mapping[str, list[int]]],
    index_manifest: Mapping[str, Any],
    params: Mapping[str, Any],
    prompt: Mapping[str, Any],
    **model_manifests: Mapping[str, Any],
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """Every model × every selected dataset.

    The models are those of the catalog manifests passed as ``model_manifests`` (name → manifest:
    base model, warm start, each trained method after merge; evaluated with
    ``evaluate.trained_models``), then those configured in ``evaluate.models``. A model that is
    configured but cannot run is an error. Returns per-sample records (all samples, failed ones
    included with ``status="failed"``), the table (one row per model × dataset) and the flat
    metrics dict the MLflow hook logs (``<model>/<dataset>/<metric>``).
    """
    config = EvaluationConfig.from_mapping(params)
    results = evaluate_manifests(params, model_manifests, selected, frequencies, index_manifest=index_manifest,
                                 prompt=prompt, links=tracking.training_link_tags,
                                 on_result=lambda result: log_evaluation(result, config.long_tail.edges))
    return _outputs(results)


def _outputs(results: list[EvaluationResult]) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    table = pd.DataFrame([{"model": r.model.name, "dataset": r.dataset, **r.metrics} for r in results])
    if not table.empty:
        table = table[TABLE_HEAD + [c for c in table.columns if c not in TABLE_HEAD]]
    metrics = {f"{r.model.name}/{r.dataset}/{k}": v for r in results for k, v in r.metrics.items() if not math.isnan(v)}
    return records_frame(results), table, metrics


def plot_comparison(table: pd.DataFrame) -> plt.Figure:
    """Precision, recall and F1 of every model, one panel per dataset."""
    return comparison_figure(table)
