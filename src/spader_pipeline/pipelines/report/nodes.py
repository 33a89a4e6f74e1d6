"""The ``report`` pipeline's node: the comparison report of the default chain
(:func:`spader_pipeline.reporting.training.training_report`), its figures and page also logged as
MLflow artifacts of the chain run (the project hook logs the metrics)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.reporting.training import training_report


def build_report(
    eval_table: pd.DataFrame,
    warm_start_metrics: Mapping[str, float],
    params: Mapping[str, Any],
    **histories: list[dict],
):
    """Figures, markdown and flat metrics comparing the methods; ``histories`` are the inputs
    ``history_<method>`` (each method's ``training_history``)."""
    curves, final, markdown, metrics = training_report(
        eval_table, warm_start_metrics, params,
        {name.removeprefix("history_"): rows or [] for name, rows in histories.items()})
    with tempfile.TemporaryDirectory() as tmp:
        for name, fig in (("training_curves.png", curves), ("final_comparison.png", final)):
            fig.savefig(Path(tmp) / name, dpi=110)
        (Path(tmp) / "report.md").write_text(markdown)
        tracking.log_artifact(tmp, artifact_path="report")
    return curves, final, markdown, metrics
