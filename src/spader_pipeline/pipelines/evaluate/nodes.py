"""Thin nodes around :mod:`spader_pipeline.evaluation`: pick the datasets, count entity frequencies,
evaluate every model × dataset (:func:`spader_pipeline.evaluation.suite.evaluate_models`) and log
each evaluation as an MLflow run linked to the training run of its checkpoint."""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import mlflow
import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.data.schema import frame_records
from spader_pipeline.evaluation.config import EvaluationConfig
from spader_pipeline.evaluation.metrics import entity_corpus_frequency
from spader_pipeline.evaluation.plots import comparison_figure, sample_figure
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
                                 on_result=lambda result: _log_evaluation(result, config.long_tail.edges))
    return _outputs(results)


def _outputs(results: list[EvaluationResult]) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    table = pd.DataFrame([{"model": r.model.name, "dataset": r.dataset, **r.metrics} for r in results])
    if not table.empty:
        table = table[TABLE_HEAD + [c for c in table.columns if c not in TABLE_HEAD]]
    metrics = {f"{r.model.name}/{r.dataset}/{k}": v for r in results for k, v in r.metrics.items() if not math.isnan(v)}
    return records_frame(results), table, metrics


def _log_evaluation(result: EvaluationResult, edges) -> None:
    """One MLflow run per model × dataset, linked to the chain run, tagged ``model``, ``dataset`` and —
    for a trained checkpoint — ``method`` and ``training_run_id``, with a link to that run in its
    description, the metrics also logged against the checkpoint's MLflow model and the headline
    scores copied onto the training run (``heldout/<dataset>/…``). Params, per-sample file, plot."""
    if not tracking.active():
        return
    spec, dataset = result.model, result.dataset
    tags = {"model": spec.name, "dataset": dataset, "kind": spec.kind, **spec.training}
    note = _training_note(spec.training)
    if note:
        tags["mlflow.note.content"] = note
    with tracking.linked_run(f"evaluate:{spec.name}:{dataset}", tags), tempfile.TemporaryDirectory() as tmp:
        tracking.log_params({**spec.describe(), "dataset": dataset, "prompt_template": result.template_name,
                             **{f"rollout.{k}": v for k, v in asdict(result.rollout).items()}})
        values = tracking.numeric_items(result.metrics)
        mlflow.log_metrics(values, model_id=_model_in_store(spec.training.get("checkpoint.model_id")))
        tracking.log_heldout(spec.training.get("training_run_id"), dataset, values)
        path = Path(tmp) / f"{spec.name}__{dataset}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in result.records),
                        encoding="utf-8")
        tracking.log_artifact(path, "samples")
        fig = sample_figure(result.records, result.metrics, edges, f"{spec.name} on {dataset}")
        png = Path(tmp) / f"{spec.name}__{dataset}.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        tracking.log_artifact(png, "plots")


def _model_in_store(model_id: str | None) -> str | None:
    """The checkpoint's MLflow model id when it is in this tracking store (its metrics then also
    appear on the model's page), else ``None`` (e.g. trained against another store)."""
    if not model_id:
        return None
    try:
        return mlflow.get_logged_model(model_id).model_id
    except mlflow.exceptions.MlflowException:
        return None


def _training_note(link: Mapping[str, str]) -> str | None:
    """Markdown description of an evaluation run: which training run made the checkpoint (a link)."""
    run_id = link.get("training_run_id")
    if not run_id:
        return None
    try:
        run = mlflow.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return f"Checkpoint `{link.get('checkpoint.path')}` from training run `{run_id}` (not in this tracking store)."
    url = tracking.run_url(run_id, run.info.experiment_id)
    return f"Checkpoint `{link.get('checkpoint.path')}` trained in run [{run.info.run_name}]({url})."


def plot_comparison(table: pd.DataFrame) -> plt.Figure:
    """Precision, recall and F1 of every model, one panel per dataset."""
    return comparison_figure(table)
