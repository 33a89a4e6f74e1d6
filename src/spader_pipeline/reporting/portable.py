"""The portable run's report (:mod:`spader_pipeline.portable`): held-out scores per model with
question-bootstrap intervals, each model's paired difference from the warm start and each trained model's
from the one trained before it, the questions each got better or worse on, and what moved the answers
(:func:`summarise`); their markdown tables with the stages' times and, per RL step, the mechanism and
where the step's time went (:func:`summary_markdown`); the validation and training curves
(:func:`plot_curves`), what the run ran on (:func:`environment`) and the files that hold them
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

#: held-out means per model beside the scores: how the answers moved (docs/metrics.md)
MECHANISM = ("precision", "seen_recall", "answered_given_seen")
#: the per-step table's columns, from each method's training history: (metric, heading, format)
STEP_COLUMNS = (
    ("answer/recall", "batch recall", ".3f"), ("policy/entropy", "entropy", ".3f"),
    ("group/distinct_docs", "distinct docs", ".1f"), ("adv/zero_frac", "adv zero", ".3f"),
    ("adv/corr_vs_grpo", "corr vs GRPO", ".2f"), ("perf/step_seconds", "step s", ".1f"),
    ("perf/rollout_seconds", "rollout s", ".1f"), ("perf/rollout_model_seconds", "in the model", ".1f"),
    ("perf/rollout_prefill_seconds", "prefill", ".1f"), ("perf/rollout_decoding_seconds", "decoding", ".1f"),
    ("perf/rollout_prefill_padding", "prefill padding", ".2f"), ("perf/rollout_decode_steps", "decoding steps", ".0f"),
    ("perf/update_seconds", "update s", ".1f"),
)


def summarise(records: Sequence[Mapping[str, Any]], bootstrap: Mapping[str, Any], *, reference: str,
              order: Sequence[str] = ()) -> dict[str, Any]:
    """Held-out recall and F1 per model with question-bootstrap intervals, each model's paired difference
    from ``reference`` and each trained model's from every one before it (one seed: ``[1, Q]`` grids of
    :mod:`spader_pipeline.evaluation.bootstrap`). Models in the order ``reference``, ``order`` (the methods
    as the run lists them, not as they finished), then any other. A failed record scores 0, as in the
    compare report."""
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
    ranked = [reference, *order]
    scores = dict(sorted(scores.items(), key=lambda item: ranked.index(item[0]) if item[0] in ranked else len(ranked)))
    models: dict[str, Any] = {}
    for model, grid in scores.items():
        entry: dict[str, Any] = {"failed": grid["failed"], "searches": grid["searches"]}
        for metric in ("recall", "f1"):
            entry[metric] = bootstrap_interval(grid[metric], **options).as_dict()
            if model != reference and reference in scores:
                diff = paired_difference(scores[reference][metric], grid[metric], **options)
                entry[f"{metric}_minus_{reference}"] = diff.as_dict()
        if model != reference and reference in scores:  # question by question, on recall
            delta = grid["recall"][0] - scores[reference]["recall"][0]
            entry["questions"] = {"better": int((delta > 0).sum()), "worse": int((delta < 0).sum()),
                                  "same": int((delta == 0).sum())}
        ok = frame[frame["model"].eq(model) & frame["status"].eq("ok")]
        entry["mechanism"] = {m: float(ok[m].mean()) if m in ok and ok[m].notna().any() else float("nan")
                              for m in MECHANISM}
        models[model] = entry
    trained = [model for model in scores if model != reference]
    pairs = {f"{b}_minus_{a}": {m: paired_difference(scores[a][m], scores[b][m], **options).as_dict()
                                for m in ("recall", "f1")}
             for i, a in enumerate(trained) for b in trained[i + 1:]}
    return {"models": models, "reference": reference, "seeds": 1, "pairs": pairs}


def _interval(value: Mapping[str, float]) -> str:
    return f"{value['mean']:+.3f} [{value['low']:+.3f}, {value['high']:+.3f}]"


def summary_markdown(summary: Mapping[str, Any], curves: Mapping[str, Sequence[Mapping[str, float]]] | None = None) -> str:
    """The summary's tables: one row per model (recall, F1, difference from the reference, questions better /
    worse / same); each later trained model against each earlier one; the held-out mechanism; the stages'
    seconds; and, given the methods' training ``curves``, one row per method and RL step (:data:`STEP_COLUMNS`)."""
    ref = summary["reference"]
    lines = [f"| model | recall [95% CI] | F1 | recall − {ref} [95% CI] | better / worse / same | searches | failed |",
             "|---|---|---|---|---|---|---|"]
    for model, entry in summary["models"].items():
        r, f1 = entry["recall"], entry["f1"]
        diff = entry.get(f"recall_minus_{ref}")
        questions = entry.get("questions")
        counts = f"{questions['better']} / {questions['worse']} / {questions['same']}" if questions else "—"
        lines.append(f"| {model} | {r['mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | {f1['mean']:.3f} | "
                     f"{_interval(diff) if diff else '—'} | {counts} | {entry['searches']:.2f} | {entry['failed']} |")
    for pair, diff in summary.get("pairs", {}).items():
        lines.append(f"\n{pair.replace('_minus_', ' − ')}, paired over the same questions: recall "
                     f"{_interval(diff['recall'])}, F1 {_interval(diff['f1'])}")
    mechanism = {model: entry["mechanism"] for model, entry in summary["models"].items() if "mechanism" in entry}
    if mechanism:
        lines += ["", "| model | " + " | ".join(MECHANISM) + " |", "|---|" + "---|" * len(MECHANISM)]
        lines += [f"| {model} | " + " | ".join(f"{values[m]:.3f}" for m in MECHANISM) + " |"
                  for model, values in mechanism.items()]
    if summary.get("seconds"):
        lines += ["", "| stage | seconds |", "|---|---|"]
        lines += [f"| {stage} | {seconds:.1f} |" for stage, seconds in summary["seconds"].items()]
    if curves:
        ranked = [m for m in summary.get("methods", ()) if m in curves] + [m for m in curves if m not in summary.get("methods", ())]
        lines += ["", steps_markdown({m: curves[m] for m in ranked}).rstrip("\n")]
    return "\n".join(lines) + "\n"


def steps_markdown(curves: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    """One row per method and RL step of its training history: :data:`STEP_COLUMNS` (– where a step lacks one)."""
    lines = ["| method | step | " + " | ".join(heading for _, heading, _ in STEP_COLUMNS) + " |",
             "|---|---|" + "---|" * len(STEP_COLUMNS)]
    for method, history in curves.items():
        for point in history:
            if point.get("step", 0) < 1 or "answer/recall" not in point:  # step 0: the shared validation only
                continue
            cells = [format(point[key], spec) if isinstance(point.get(key), (int, float)) else "–"
                     for key, _, spec in STEP_COLUMNS]
            lines.append(f"| {method} | {int(point['step'])} | " + " | ".join(cells) + " |")
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
    (out / "summary.md").write_text(summary_markdown(summary, curves))
    plot_curves(curves, start, out / "curves.png")
