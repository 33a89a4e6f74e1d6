"""The MLflow run of one evaluation (a model on a dataset), linked to the chain run: what the
evaluate and compare nodes log for each :class:`~spader_pipeline.evaluation.suite.EvaluationResult`
as soon as it is done (docs/metrics.md, *Where the numbers are in MLflow*)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spader_pipeline import tracking


def log_evaluation(result: Any, edges: Any) -> None:
    """One run per model × dataset (``evaluation.suite.EvaluationResult``) linked to the chain run:
    tags (``model``, ``dataset``; for a checkpoint ``method`` and its training run, linked), params,
    metrics (also on the checkpoint's model and the training run: :func:`spader_pipeline.tracking.log_heldout`),
    records, plot. Nothing is logged without an active run."""
    import matplotlib.pyplot as plt

    from spader_pipeline.evaluation.plots import sample_figure

    if not tracking.active():
        return
    spec, dataset = result.model, result.dataset
    link = spec.training_link
    tags = {"model": spec.name, "dataset": dataset, "kind": spec.kind, **link}
    note = tracking.training_note(link)
    if note:
        tags["mlflow.note.content"] = note
    with tracking.linked_run(f"evaluate:{spec.name}:{dataset}", tags), tempfile.TemporaryDirectory() as tmp:
        tracking.log_params({**spec.describe(), "dataset": dataset, "prompt_template": result.template_name,
                             **{f"rollout.{k}": v for k, v in asdict(result.rollout).items()}})
        values = tracking.numeric_items(result.metrics)
        tracking.log_metrics(values, model_id=tracking.model_in_store(link.get("checkpoint.model_id")))
        tracking.log_heldout(link.get("training_run_id"), dataset, values)
        path = Path(tmp) / f"{spec.name}__{dataset}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in result.records),
                        encoding="utf-8")
        tracking.log_artifact(path, "samples")
        fig = sample_figure(result.records, result.metrics, edges, f"{spec.name} on {dataset}")
        fig.savefig(Path(tmp) / f"{spec.name}__{dataset}.png", dpi=100)
        plt.close(fig)
        tracking.log_artifact(Path(tmp) / f"{spec.name}__{dataset}.png", "plots")
