"""Figures of evaluation results (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from spader_pipeline.evaluation.metrics import bucket_labels  # noqa: E402


def sample_figure(records: Sequence[Mapping[str, Any]], metrics: Mapping[str, float], edges, title: str) -> plt.Figure:
    """One model on one dataset: the F1 distribution and recall per long-tail bucket."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    f1 = [r["f1"] for r in records if r.get("status") == "ok"]
    left.hist(f1, bins=10, range=(0, 1), color="#4c72b0")
    left.set(xlabel="F1 per question", ylabel="questions", title="F1 distribution")
    labels = bucket_labels(edges)
    values = [metrics.get(f"long_tail_recall/{label}", math.nan) for label in labels]
    right.bar(labels, [0 if math.isnan(v) else v for v in values], color="#55a868")
    right.set(xlabel="passages mentioning the entity", ylabel="recall", ylim=(0, 1), title="Long-tail recall")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def comparison_figure(table: pd.DataFrame) -> plt.Figure:
    """Precision, recall and F1 of every model, one panel per dataset."""
    datasets = list(dict.fromkeys(table["dataset"])) if not table.empty else []
    fig, axes = plt.subplots(1, max(1, len(datasets)), figsize=(4.5 * max(1, len(datasets)), 3.9), squeeze=False,
                             layout="constrained")
    if not datasets:
        axes[0][0].text(0.5, 0.5, "no evaluations ran", ha="center", va="center")
        axes[0][0].set_axis_off()
        return fig
    metrics = ["precision", "recall", "f1"]
    for ax, dataset in zip(axes[0], datasets, strict=True):
        rows = table[table["dataset"] == dataset]
        width = 0.8 / len(metrics)
        for i, metric in enumerate(metrics):
            xs = [j + i * width for j in range(len(rows))]
            ax.bar(xs, rows[metric].fillna(0).tolist(), width=width, label=metric)
        ax.set_xticks([j + width for j in range(len(rows))], rows["model"].tolist(), rotation=20)
        ax.set(ylim=(0, 1), title=dataset)
    # below the panels: inside one, the legend hid a model's bars that reach the top (the scripted baseline's)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=len(metrics),
               fontsize="small", frameon=False)
    return fig
