"""The report of the default chain: how each RL method trained, and how the models do on held-out
questions.

Inputs are the evaluate pipeline's ``eval_table`` (one row per model × dataset) and each method's
per-step training history (one row per RL step, metric names of :mod:`spader_pipeline.native.trainer`).
Outputs (:func:`training_report`): two figures, a markdown page and flat metrics; the ``report``
pipeline's node saves them and logs them to MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from spader_pipeline.reporting.tables import markdown_table  # noqa: E402

#: Per-step training metrics, comparable ones first (same definition for every method), then the
#: method's own return, whose scale depends on the method's reward terms (docs/metrics.md).
CURVES = (
    ("answer/recall", "answer recall"),
    ("answer/f1", "answer F1"),
    ("retrieval/recall", "retrieval recall (gold in retrieved text)"),
    ("method_reward/mean", "method's own return (not comparable across methods)"),
    ("adv/corr_vs_grpo", "advantages' correlation with GRPO's on the same batch (GRPO: 1)"),
    ("adv/zero_frac", "share of model tokens with advantage 0 (no gradient)"),
    ("group/distinct_query_seqs", "distinct search sequences per group of 8"),
    ("group/entity_recall_union", "gold entities retrieved by a group (union)"),
)
#: Validation curves (greedy on the fixed validation subset, step 0 = the starting policy), drawn
#: first: whether a method learns is read here, not on the training questions it samples.
VAL_CURVES = (("recall", "validation answer recall (greedy)"), ("searches", "validation searches per question (greedy)"))
#: Mechanism metrics summarised as means over all steps (whether and why the methods' updates differ).
MECHANISM = ("adv/zero_groups", "adv/corr_vs_grpo", "adv/rel_l2_vs_grpo", "adv/zero_frac", "adv/grpo_zero_frac",
             "group/diverse_frac", "group/entity_recall_union", "group/entity_recall_mean")
FINAL_COLUMNS = ("recall", "precision", "f1", "seen_recall")
#: Why a curve has no value at a step (the metric is logged as NaN there), written in its panel.
UNDEFINED_WHY = {"adv/corr_vs_grpo": "GRPO's advantages are all 0 on that batch: nothing to correlate"}


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average (shorter at the start), so noisy per-step curves stay readable."""
    x = np.asarray(values, dtype=float)
    if window <= 1 or x.size == 0:
        return x
    csum = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


_LINE_STYLES = ("-", "--", "-.", ":")


def training_rows(history: Sequence[dict]) -> list[dict]:
    """The RL steps of a history (step 0 is the starting policy's validation, not a training step)."""
    return [h for h in history if h.get("step", 0) >= 1]


def validation_sources(histories: Mapping[str, Sequence[dict]]) -> list[str]:
    """Data sources with ``val/<source>/recall`` in any history, sorted."""
    keys = {k for rows in histories.values() for h in rows for k in h}
    return sorted(k.split("/")[1] for k in keys if k.startswith("val/") and k.endswith("/recall"))


def draw_validation_panel(ax, histories: Mapping[str, Sequence[dict]], key: str, title: str) -> None:
    """One validation metric per method over RL steps, with the starting policy's level (step 0) as a
    dashed reference line: a curve above it learned, one on it did not move."""
    start = [h[key] for rows in histories.values() for h in rows if h.get("step") == 0 and key in h]
    if start:
        ax.axhline(float(np.mean(start)), color="0.4", linestyle=(0, (4, 3)), linewidth=1.2,
                   label=f"warm start (step 0): {np.mean(start):.3f}")
    for i, (method, rows) in enumerate(histories.items()):
        points = [(h["step"], h[key]) for h in rows if key in h and math.isfinite(h[key])]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", color=f"C{i}",
                    linestyle=_LINE_STYLES[i % len(_LINE_STYLES)], label=method)
    if not start and not any(key in h for rows in histories.values() for h in rows):
        ax.text(0.5, 0.5, "no validation (training.validation)", transform=ax.transAxes, ha="center", color="0.4")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def curves_figure(histories: Mapping[str, list[dict]], window: int):
    """Validation curves (top row), then the training curves of :data:`CURVES`, one line per method."""
    sources = validation_sources(histories)
    source = sources[0] if sources else "embedded"
    validation = dict(histories)
    histories = {m: training_rows(rows) for m, rows in histories.items()}
    # A short run is drawn as it is: a moving average wider than a third of the run hides its steps.
    window = min(window, max(1, max((len(rows) for rows in histories.values()), default=0) // 3))
    fig, axes = plt.subplots(5, 2, figsize=(11, 15.5), sharex=True)
    for ax, (name, title) in zip(axes[0], VAL_CURVES, strict=True):
        draw_validation_panel(ax, validation, f"val/{source}/{name}", f"{title}: {source}")
    for ax, (key, title) in zip(axes[1:].flat, CURVES, strict=True):
        undefined = []
        for i, (method, rows) in enumerate(histories.items()):
            missing = [r["step"] for r in rows if isinstance(r.get(key), float) and math.isnan(r[key])]
            if missing:
                undefined.append(f"{method}: step{'s' if len(missing) > 1 else ''} {_step_list(missing)}")
            rows = [r for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]  # NaN: undefined
            if rows:
                steps, values = [r["step"] for r in rows], [r[key] for r in rows]
                color = f"C{i}"
                # Each step as a faint point (short CPU runs have few), the moving average as the line;
                # one line style per method, so identical curves (same seed, same samples) stay visible.
                ax.plot(steps, values, "o", color=color, alpha=0.3, markersize=4)
                ax.plot(steps, smooth(values, window), color=color, linestyle=_LINE_STYLES[i % len(_LINE_STYLES)],
                        linewidth=2.2 - 0.4 * (i % 3), label=f"{method} ({len(rows)} steps)")
        if undefined:  # say so in the panel instead of leaving it blank
            why = UNDEFINED_WHY.get(key, "not defined")
            ax.text(0.02, 0.04, f"undefined ({why}):\n" + "\n".join(undefined), transform=ax.transAxes,
                    fontsize=8, color="0.35", va="bottom")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0, 0].legend()
    lines = f"lines: moving average over {window} steps" if window > 1 else "lines join the steps"
    fig.suptitle(f"Top row: validation (greedy, fixed validation questions; step 0 = the warm start). Below: training "
                 f"questions (points: steps; {lines})\nrecall, F1 and retrieval recall compare the methods; the return includes each "
                 "method's own terms.\nSame sampling seed: step 1 samples the same trajectories for every method and "
                 "the advantage panels show how each scores them;\nlater steps sample from each method's own policy",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))  # room for the four-line title
    return fig


def _step_list(steps: Sequence[int]) -> str:
    """``1, 2, 5`` (at most 8 listed)."""
    shown = ", ".join(str(s) for s in steps[:8])
    return shown + (f" … ({len(steps)} in all)" if len(steps) > 8 else "")


def final_table(eval_table: pd.DataFrame, params: Mapping[str, Any]) -> pd.DataFrame:
    """The held-out rows of ``params.datasets`` × ``params.models`` (in that order), headline columns first."""
    frame = eval_table.copy()
    datasets = params.get("datasets")
    if datasets:
        frame = frame[frame["dataset"].isin(datasets)]
    models = params.get("models")
    if models:
        frame = frame[frame["model"].isin(models)]
        frame["_order"] = frame["model"].map({m: i for i, m in enumerate(models)})
        frame = frame.sort_values(["dataset", "_order"]).drop(columns="_order")
    long_tail = [c for c in frame.columns if c.startswith("long_tail_recall/")]
    columns = ["model", "dataset", "num_samples", "num_failed", *[c for c in FINAL_COLUMNS if c in frame], *long_tail]
    return frame[[c for c in columns if c in frame.columns]].reset_index(drop=True)


def final_figure(table: pd.DataFrame):
    """Bars of every held-out score per model, one panel per dataset."""
    datasets = list(dict.fromkeys(table["dataset"])) or ["(none)"]
    metrics = [c for c in (*FINAL_COLUMNS, *[c for c in table.columns if c.startswith("long_tail_recall/")])
               if c in table and table[c].notna().any()]  # a bucket no entity falls in has no bars
    fig, axes = plt.subplots(len(datasets), 1, figsize=(max(8, 1.2 * len(metrics) + 4), 3.6 * len(datasets)), squeeze=False)
    for ax, dataset in zip(axes[:, 0], datasets, strict=True):
        rows = table[table["dataset"] == dataset]
        width = 0.8 / max(len(rows), 1)
        for i, (_, row) in enumerate(rows.iterrows()):
            values = [float(row[m]) if pd.notna(row[m]) else 0.0 for m in metrics]
            ax.bar(np.arange(len(metrics)) + i * width, values, width, label=row["model"])
        ax.set_xticks(np.arange(len(metrics)) + 0.4 - width / 2)
        ax.set_xticklabels([m.replace("long_tail_recall/", "tail ") for m in metrics], rotation=20)
        ax.set_title(f"held-out: {dataset}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def training_summary(histories: Mapping[str, list[dict]], window: int) -> pd.DataFrame:
    """Per method: the first and last ``window`` steps' means, the mechanism means, validation start and end."""
    rows = []
    for method, full in histories.items():
        history = training_rows(full)
        if not history:
            continue
        # First and last `window` steps; a run shorter than two windows is split in halves, so the
        # two columns never average the same steps.
        size = max(1, min(window, len(history) // 2))
        head, tail = history[:size], history[-size:]
        row: dict[str, Any] = {"method": method, "steps": int(history[-1]["step"]), "window": size,
                               "minutes": sum(h.get("perf/step_seconds", 0.0) for h in history) / 60}
        for key, _ in CURVES:
            row[f"{key} first"] = float(np.mean([h[key] for h in head if key in h]))
            row[f"{key} last"] = float(np.mean([h[key] for h in tail if key in h]))
        for key in MECHANISM:
            values = [h[key] for h in history if isinstance(h.get(key), int | float) and math.isfinite(h[key])]
            row[f"{key} mean"] = float(np.mean(values)) if values else math.nan
        for source in validation_sources({method: full}):
            curve = [(h["step"], h[f"val/{source}/recall"]) for h in full if f"val/{source}/recall" in h]
            row[f"val/{source}/recall step {curve[0][0]}"] = curve[0][1]
            row[f"val/{source}/recall step {curve[-1][0]}"] = curve[-1][1]
        rows.append(row)
    return pd.DataFrame(rows)


def training_report(
    eval_table: pd.DataFrame,
    warm_start_metrics: Mapping[str, float],
    params: Mapping[str, Any],
    histories: Mapping[str, list[dict]],
):
    """Figures (training curves, held-out comparison), markdown and flat metrics comparing the methods
    of ``histories`` (method → per-step history); ``params`` is the ``report`` block."""
    window = int(params.get("smoothing_window", 10))
    curves = curves_figure(histories, window)
    table = final_table(eval_table, params)
    final = final_figure(table)
    summary = training_summary(histories, window)

    lines = [
        f"# {params.get('title', 'GRPO vs SPADER')}\n",
        "Compare the methods on the held-out results and on the training metrics `answer/*` and "
        "`retrieval/*`: they mean the same for every method. `method_reward/*` is each method's own "
        "return (SPADER's adds a discovery term), so its scale differs between methods "
        "(docs/metrics.md, *Comparable metrics*).\n",
        "Held-out evaluation (evaluate pipeline; `seen_recall` = gold entities present in retrieved text, "
        "`long_tail_recall/<bucket>` = recall of gold entities by corpus frequency):\n",
        markdown_table(table),
        f"\nTraining on the training questions: means over the first and last `window` RL steps ({window}, or "
        "half the steps of a shorter run):\n",
        markdown_table(summary),
    ]
    if warm_start_metrics:
        lines += ["\nWarm start:\n", markdown_table(pd.DataFrame([dict(warm_start_metrics)]))]
    markdown = "\n".join(lines)

    metrics: dict[str, float] = {}
    for row in table.to_dict(orient="records"):
        for key in (*FINAL_COLUMNS, *[c for c in row if c.startswith("long_tail_recall/")]):
            if key in row and row[key] is not None and not (isinstance(row[key], float) and math.isnan(row[key])):
                metrics[f"{row['model']}/{row['dataset']}/{key}"] = float(row[key])
    for row in summary.to_dict(orient="records"):
        for key, value in row.items():
            if key != "method" and isinstance(value, int | float) and math.isfinite(value):
                metrics[f"{row['method']}/{key.replace(' ', '_')}"] = float(value)

    return curves, final, markdown, metrics
