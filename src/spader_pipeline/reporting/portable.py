"""The portable run's report (:mod:`spader_pipeline.portable`): held-out scores per model with
question-bootstrap intervals and each model's paired difference from the warm start
(:func:`summarise`), their markdown table (:func:`summary_markdown`), the validation and training
curves (:func:`plot_curves`), what the run ran on (:func:`environment`) and the files that hold them
(:func:`write_outputs`).

One seed: the intervals are over questions only, and say nothing of the seed-to-seed spread.
"""

from __future__ import annotations

import json
import logging
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline.evaluation.bootstrap import bootstrap_interval, paired_difference

logger = logging.getLogger(__name__)


def summarise(records: Sequence[Mapping[str, Any]], bootstrap: Mapping[str, Any], *, reference: str) -> dict[str, Any]:
    """Held-out recall and F1 per model with question-bootstrap intervals, and each model's paired
    difference from ``reference`` (one seed: ``[1, Q]`` grids of :mod:`spader_pipeline.evaluation.bootstrap`).
    A failed record scores 0, as in the compare report."""
    frame = pd.DataFrame.from_records(list(records))
    for column in ("recall", "f1", "num_searches"):  # failed records carry none: a model of only those lacks them
        if column not in frame:
            frame[column] = np.nan
    options = {k: bootstrap[k] for k in ("resamples", "confidence", "seed") if k in bootstrap}
    scores: dict[str, dict[str, np.ndarray]] = {}
    for model, rows in frame.groupby("model", sort=False):
        rows = rows.sort_values("id")
        ok = rows["status"].eq("ok").to_numpy()
        scores[str(model)] = {m: np.where(ok, rows[m].fillna(0.0).to_numpy(float), 0.0)[None, :]
                              for m in ("recall", "f1")}
        scores[str(model)]["failed"] = int((~ok).sum())
        scores[str(model)]["searches"] = float(rows.loc[ok, "num_searches"].mean()) if ok.any() else float("nan")
    models: dict[str, Any] = {}
    for model, grid in scores.items():
        entry: dict[str, Any] = {"failed": grid["failed"], "searches": grid["searches"]}
        for metric in ("recall", "f1"):
            entry[metric] = bootstrap_interval(grid[metric], **options).as_dict()
            if model != reference and reference in scores:
                diff = paired_difference(scores[reference][metric], grid[metric], **options)
                entry[f"{metric}_minus_{reference}"] = diff.as_dict()
        models[model] = entry
    return {"models": models, "reference": reference, "seeds": 1}


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """The summary's table: one row per model (recall, F1, difference from the reference)."""
    ref = summary["reference"]
    lines = [f"| model | recall [95% CI] | F1 | recall − {ref} [95% CI] | searches | failed |",
             "|---|---|---|---|---|---|"]
    for model, entry in summary["models"].items():
        r, f1 = entry["recall"], entry["f1"]
        diff = entry.get(f"recall_minus_{ref}")
        shown = f"{diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]" if diff else "—"
        lines.append(f"| {model} | {r['mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | {f1['mean']:.3f} | {shown} "
                     f"| {entry['searches']:.2f} | {entry['failed']} |")
    return "\n".join(lines) + "\n"


def plot_curves(curves: Mapping[str, Sequence[Mapping[str, float]]], start: Mapping[str, float], path: Path) -> None:
    """Two panels per RL step, one line per method: validation recall (greedy), the warm start's level
    dashed; and the training batch's recall (sampled, fresh questions each step until the training
    split repeats) beside the policy's entropy, the mechanism behind a sampled gain that greedy
    decoding does not show (a sharper policy samples closer to its greedy answer)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:  # the plot is a convenience; curves.json holds the numbers
        logger.warning("matplotlib is not installed: no %s", path.name)
        return
    fig, (validation, training) = plt.subplots(1, 2, figsize=(11, 4))
    entropy = training.twinx()
    for i, (method, history) in enumerate(curves.items()):
        color = f"C{i}"
        points = [(h["step"], v) for h in history for k, v in h.items() if k.startswith("val/") and k.endswith("/recall")]
        if points:
            validation.plot(*zip(*points, strict=True), marker="o", color=color, label=method)
        sampled = [(h["step"], h["answer/recall"]) for h in history if "answer/recall" in h]
        if sampled:
            training.plot(*zip(*sampled, strict=True), marker="o", color=color, label=f"{method} recall")
        spread = [(h["step"], h["policy/entropy"]) for h in history if "policy/entropy" in h]
        if spread:
            entropy.plot(*zip(*spread, strict=True), marker="x", linestyle=":", color=color, label=f"{method} entropy")
    for key, value in start.items():
        if key.endswith("/recall"):
            validation.axhline(value, linestyle="--", color="grey", label="warm start")
    validation.set(xlabel="RL step", ylabel="validation recall (greedy)", title="held-out validation questions")
    training.set(xlabel="RL step", ylabel="training batch recall (sampled)", title="the step's rollouts")
    entropy.set_ylabel("policy entropy (dotted)")
    for ax in (validation, training):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    validation.legend()
    lines, labels = training.get_legend_handles_labels()
    more, more_labels = entropy.get_legend_handles_labels()
    training.legend(lines + more, labels + more_labels, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: str, bf16: bool | str = "auto", *, bf16_weights: bool = False) -> dict[str, str]:
    """What the run ran on: device name, torch, transformers and Python versions, and how it decoded
    (``decode.*``, with ``bf16`` autocast and the rollout's weights as the trainer's settings give them:
    :func:`~spader_pipeline.modeling.decode_step.decoding_path`)."""
    import torch
    import transformers

    from spader_pipeline.modeling.decode_step import decoding_path

    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else (platform.processor() or platform.machine())
    return {"device": device, "device_name": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), **decoding_path(device, bf16, bf16_weights=bf16_weights)}


def write_outputs(out: Path, summary: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
                  curves: Mapping[str, Sequence[Mapping[str, float]]], start: Mapping[str, float]) -> None:
    """The run's files in ``out``: ``heldout_records.jsonl``, ``curves.json``/``.png`` (``start``: the
    warm start's validation, drawn as a line), ``summary.json``/``.md``."""
    with (out / "heldout_records.jsonl").open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    (out / "curves.json").write_text(json.dumps(curves, indent=1, default=float))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    (out / "summary.md").write_text(summary_markdown(summary))
    plot_curves(curves, start, out / "curves.png")
