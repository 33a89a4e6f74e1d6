"""The report of ``make positive-control``: does the RL loop learn what it is rewarded for?

Each cell (method × seed) trains from the shared warm start on a small fixed set of training
questions (the *fitted set*) and is scored on exactly those questions from step 0
on the design's ``metric`` (``f1``, the reward's final-answer F1, or ``recall``): ``val/fitted/<metric>``,
each question's mean over the trajectories ``training.validation`` samples for it (or its greedy
trajectory), beside the training batches' own ``answer/<metric>`` (the same questions as the loop samples
them, first third of the steps against the last: the learning curve), the same questions greedy
(``val/fitted_greedy/<metric>``) and the first questions of the validation split (held out); none of
these three has a target. The warm start's score is step 0 of every curve.

The verdict holds two targets (docs/results.md says how they were chosen): **every cell** gains at
least ``target_gain``, and **the mean over cells** gains at least ``target_mean_gain`` with the lower
end of its interval above 0, the interval the wider of a t interval over the cells' gains (``df =
cells − 1``) and a percentile bootstrap over cells. The gauge's grain is stated beside it: one
trajectory moves a cell's score by at most ``1 / (fitted questions × trajectories per question)``.
This answers "does the loop learn", not "does it generalise": the fitted questions are the training
questions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from spader_pipeline.evaluation.bootstrap import Interval, bootstrap_interval, paired_t_interval, wider
from spader_pipeline.reporting.tables import markdown_table

#: ``data_source`` of the fitted questions in the validation set (``val/fitted/…``), scored as
#: ``training.validation`` says for it (sampled trajectories in ``make positive-control``)
FITTED_SOURCE = "fitted"
#: the same questions again, each greedy and alone (``val/fitted_greedy/…``): the curve of earlier designs, no target
FITTED_GREEDY_SOURCE = "fitted_greedy"


def _series(history: Sequence[Mapping[str, float]], key: str) -> list[tuple[int, float]]:
    return [(int(h["step"]), float(h[key])) for h in history if key in h]


def held_out_source(histories: Mapping[str, Sequence[Mapping[str, float]]]) -> str | None:
    """The validation split's data source in the curves (the one ``val/<source>/recall`` that is not
    the fitted set, scored greedy or sampled), or ``None``."""
    sources = {k.split("/")[1] for history in histories.values() for h in history for k in h
               if k.startswith("val/") and k.endswith("/recall")}
    others = sorted(sources - {FITTED_SOURCE, FITTED_GREEDY_SOURCE})
    return others[0] if others else None


def cell_outcomes(histories: Mapping[str, Sequence[Mapping[str, float]]], target_gain: float,
                  metric: str = "recall") -> list[dict[str, Any]]:
    """Per cell: the fitted score (``val/fitted/<metric>``) at step 0 and at its last validated step, the
    gain, whether it reached ``target_gain``, the greedy score beside and the held-out score at both ends."""
    held = held_out_source(histories)
    rows = []
    for cell, history in histories.items():
        fitted = _series(history, f"val/{FITTED_SOURCE}/{metric}")
        validation = _series(history, f"val/{held}/{metric}") if held else []
        if not fitted:
            raise ValueError(f"cell {cell}: no val/{FITTED_SOURCE}/{metric} in its history (validation off?)")
        (first_step, start), (last_step, end) = fitted[0], fitted[-1]
        if first_step != 0:
            raise ValueError(f"cell {cell}: its fitted curve starts at step {first_step}, not at the warm start (0)")
        row = {"cell": cell, "steps": last_step, "fitted_start": start, "fitted_end": end,
               "fitted_best": max(v for _, v in fitted), "gain": end - start,
               # recalls are fractions of answers: a gain equal to the target counts, whatever the rounding
               "reached": end - start >= target_gain - 1e-9}
        if validation:
            row.update(validation_start=validation[0][1], validation_end=validation[-1][1])
        if greedy := _series(history, f"val/{FITTED_GREEDY_SOURCE}/{metric}"):
            row.update(greedy_start=greedy[0][1], greedy_end=greedy[-1][1])
        if thirds := training_thirds(history, metric):
            row.update(thirds, training_rise=thirds["training_end"] - thirds["training_start"])
        rows.append(row)
    return rows


def training_thirds(history: Sequence[Mapping[str, float]], metric: str) -> dict[str, float]:
    """The training batches' own ``answer/<metric>`` (the fitted questions sampled at the training
    temperature, ``prompts_per_step × group_size`` trajectories a step) averaged over the first and the
    last third of the steps (``training_start``, ``training_end``; empty with fewer than 2 steps): the
    loop's learning curve, beside the gauge, without a target."""
    ends = _first_and_last_third(history, f"answer/{metric}")
    return {"training_start": ends[0], "training_end": ends[1]} if ends else {}


def _first_and_last_third(history: Sequence[Mapping[str, float]], key: str) -> tuple[float, float] | None:
    """``key``'s mean over the first and over the last third of the RL steps (step ≥ 1) that log it;
    ``None`` with fewer than 2 such steps."""
    values = [float(h[key]) for h in history if h.get("step", 0) >= 1 and key in h]
    if len(values) < 2:
        return None
    third = max(1, len(values) // 3)
    return float(np.mean(values[:third])), float(np.mean(values[-third:]))


#: what a cell's training batches say about its mechanism (key, column): the method's own reward (F1 for
#: GRPO; F1 plus the exploration term for SPADER, docs/algorithms.md), its exploration part, the gold
#: answers found in the retrieved text, and how sharp the policy is (docs/metrics.md)
MECHANISM_COLUMNS = (
    ("method_reward/mean", "own reward (what it optimises)"),
    ("method_reward/discovery_mean", "of which exploration"),
    ("retrieval/recall", "gold answers retrieved"),
    ("policy/entropy", "token entropy"),
)


def mechanism_table(histories: Mapping[str, Sequence[Mapping[str, float]]],
                    trainers: Mapping[str, str] | None = None) -> tuple[str, dict[str, float]]:
    """Per cell, each of :data:`MECHANISM_COLUMNS` over its training batches, first third of the steps →
    last (``—`` where the cell does not log it; with ``trainers`` a trainer column after the cell's, as in
    the verdict's table): markdown and ``<cell>/reward_rise`` (its own reward's rise). Empty where no cell
    logs its own reward."""
    rows, metrics = [], {}
    for cell, history in histories.items():
        row = [cell]
        for key, _ in MECHANISM_COLUMNS:
            ends = _first_and_last_third(history, key)
            row.append(f"{ends[0]:.3f} → {ends[1]:.3f}" if ends else "—")
            if ends and key == MECHANISM_COLUMNS[0][0]:
                metrics[f"{cell}/reward_rise"] = ends[1] - ends[0]
        rows.append(row)
    if not metrics:  # no cell logs its own reward
        return "", {}
    table = markdown_table(pd.DataFrame(rows, columns=["cell", *(name for _, name in MECHANISM_COLUMNS)])
                           .pipe(_with_trainer_column, trainers))
    return table, metrics


def fitted_count(design: Mapping[str, Any]) -> int:
    """The fitted set's size: ``question_ids``' length where it names them, else ``questions``."""
    return len(design.get("question_ids") or ()) or int(design["questions"])


def mean_gain_interval(gains: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of the cells' ``gains`` (``[cells]``) with the wider of its t interval over cells (``df =
    cells − 1``) and its percentile bootstrap over cells (rule 11: with few cells the t interval is the
    honest one; the bootstrap draws only from the cells it was given)."""
    values = np.asarray(gains, dtype=float)
    return wider(paired_t_interval(np.zeros_like(values), values, confidence=confidence),
                 bootstrap_interval(values[None, :], confidence=confidence))


def verdict(rows: Sequence[Mapping[str, Any]], design: Mapping[str, Any]) -> dict[str, Any]:
    """Whether the cells ``rows`` (:func:`cell_outcomes`) pass both targets of ``design``: every cell at
    ``target_gain`` or more, and the mean gain at ``target_mean_gain`` or more with its interval's lower
    end above 0 (:func:`mean_gain_interval` at ``confidence``)."""
    interval = mean_gain_interval([r["gain"] for r in rows], float(design.get("confidence", 0.95)))
    mean_target = float(design.get("target_mean_gain", design["target_gain"]))
    every = all(r["reached"] for r in rows)
    mean = interval.mean >= mean_target - 1e-9 and interval.low > 0
    return {"cells": len(rows), "reached": sum(r["reached"] for r in rows), "every_cell": every,
            "mean": interval, "mean_target": mean_target, "mean_reached": mean, "learns": every and mean}


def build_report(histories: Mapping[str, Sequence[Mapping[str, float]]], design: Mapping[str, Any],
                 trainers: Mapping[str, str] | None = None, grain: float | None = None,
                 gauge: str | None = None) -> tuple[str, Any, dict[str, float]]:
    """Markdown, figure and metrics of the positive control. ``design``: ``questions`` (fitted-set
    size, unless ``question_ids`` names them), ``validation_questions``, ``metric`` (``val/…/<metric>``:
    ``f1`` or ``recall``, the default), ``target_gain`` (every cell),
    ``target_mean_gain`` and ``confidence`` (the mean over cells). ``trainers`` (cell → ``native`` or
    ``verl``): a trainer column after the cell's and a verdict per trainer, for one table of both
    trainers' cells (``make positive-control-verl``); the metrics are over every cell, and with
    ``trainers`` each trainer's under ``<trainer>/``. ``grain``: the most one trajectory moves a cell's
    fitted score; ``gauge``: what that score is, in words (e.g. the trajectories it is a mean over)."""
    target, metric = float(design["target_gain"]), str(design.get("metric", "recall"))
    fitted = fitted_count(design)
    rows = cell_outcomes(histories, target, metric)
    held = held_out_source(histories)
    # verl samples every validation question as it samples the fitted ones (one val_kwargs for all)
    decoded = "greedy; verl cells: sampled as the fitted" if "verl" in (trainers or {}).values() else "greedy"
    held_column = f"validation {metric} ({held or '—'}, {decoded}): warm start → last"
    table = markdown_table(pd.DataFrame(
        [[r["cell"], r["steps"], f"{r['fitted_start']:.3f} → {r['fitted_end']:.3f}", f"{r['gain']:+.3f}",
          "yes" if r["reached"] else "no",
          f"{r['training_start']:.3f} → {r['training_end']:.3f}" if "training_end" in r else "—",
          f"{r['greedy_start']:.3f} → {r['greedy_end']:.3f}" if "greedy_end" in r else "—",
          f"{r['validation_start']:.3f} → {r['validation_end']:.3f}" if "validation_end" in r else "—"]
         for r in rows],
        columns=["cell", "steps", f"fitted {metric}: warm start → last", "gain", f"≥ +{target:.2f}",
                 "training batches: first third of the steps → last (no target)",
                 "fitted, greedy alone (no target)", held_column])
        .pipe(_with_trainer_column, trainers))
    groups = {"": rows}  # every cell; then, with trainers, each trainer's cells (its own verdict, <trainer>/…)
    for trainer in dict.fromkeys((trainers or {}).values()):
        groups[trainer] = [r for r in rows if trainers[r["cell"]] == trainer]
    lines, metrics = [], {}
    for trainer, group in groups.items():
        if not group:
            continue
        found = verdict(group, design)
        if trainer or not trainers:
            lines.append(_verdict_line(found, target, metric, trainer or None))
        prefix = f"{trainer}/" if trainer else ""
        metrics |= {f"{prefix}cells_reached": float(found["reached"]), f"{prefix}cells": float(found["cells"]),
                    f"{prefix}mean_gain": found["mean"].mean, f"{prefix}mean_gain_low": found["mean"].low,
                    f"{prefix}mean_gain_high": found["mean"].high, f"{prefix}learns": float(found["learns"]),
                    f"{prefix}min_gain": float(min(r["gain"] for r in group))}
    grain_text = (f". One trajectory moves a cell's fitted score by at most {grain:.3f}" if grain else "")
    rises = [r["training_rise"] for r in rows if "training_rise" in r]
    training_text = []
    if len(rises) == len(rows) and len(rows) > 1:
        rise = mean_gain_interval(rises, float(design.get("confidence", 0.95)))
        metrics |= {"training_rise": rise.mean, "training_rise_low": rise.low, "training_rise_high": rise.high}
        training_text = [f"- The training batches' own {metric} (the fitted questions sampled as the loop samples "
                         f"them), from the first third of the steps to the last: **{rise.mean:+.3f}** "
                         f"[{rise.low:+.3f}, {rise.high:+.3f}] over cells, {sum(x > 0 for x in rises)} of "
                         f"{len(rises)} cells rising (the loop's learning curve; no target)."]
    mechanism, mechanism_metrics = mechanism_table(histories, trainers)
    metrics |= mechanism_metrics
    text = "\n".join([
        "# Positive control: does the loop learn what it is rewarded for?", "",
        f"Each cell trained from the shared warm start on the same {fitted} training questions "
        f"and was scored on them from step 0{f' ({gauge})' if gauge else ''}{grain_text}. The validation split's first "
        f"{design['validation_questions']} questions are held out (no target).", "",
        *lines, *training_text, "", table,
        "The fitted questions are the training questions: a gain here shows that the loop learns what it "
        "is rewarded for, not that it generalises (held-out gains: docs/gpu.md).", "",
        *(["What each cell was rewarded for, and what moved (its training batches, first third of the steps "
           "→ last; no target):", "", mechanism, ""] if mechanism else [])])
    for r in rows:
        metrics[f"{r['cell']}/gain"] = r["gain"]
        if "greedy_end" in r:
            metrics[f"{r['cell']}/greedy_gain"] = r["greedy_end"] - r["greedy_start"]
        if "validation_end" in r:
            metrics[f"{r['cell']}/validation_gain"] = r["validation_end"] - r["validation_start"]
        if "training_rise" in r:
            metrics[f"{r['cell']}/training_rise"] = r["training_rise"]
    return text, plot_curves(histories, held, target, metric), metrics


def _verdict_line(found: Mapping[str, Any], target: float, metric: str, trainer: str | None) -> str:
    interval: Interval = found["mean"]
    who = f"{trainer}: " if trainer else ""
    outcome = "**the loop learns**" if found["learns"] else "**not shown**"
    return (f"- {who}{outcome}: **{found['reached']} of {found['cells']} cells** gained at least +{target:.2f} "
            f"fitted {metric}; the mean gain over cells is **{interval.mean:+.3f}** "
            f"[{interval.low:+.3f}, {interval.high:+.3f}] ({interval.confidence:.0%}, the wider of a t interval "
            f"over cells and a bootstrap over cells; target ≥ +{found['mean_target']:.2f} with the interval above 0).")


def _with_trainer_column(table: pd.DataFrame, trainers: Mapping[str, str] | None) -> pd.DataFrame:
    """``table`` with a ``trainer`` column after ``cell`` (each cell's ``trainers`` entry); as it is without ``trainers``."""
    if trainers is not None:
        table.insert(1, "trainer", [trainers[cell] for cell in table["cell"]])
    return table


def plot_curves(histories: Mapping[str, Sequence[Mapping[str, float]]], held: str | None, target: float,
                metric: str = "recall"):
    """The fitted score (left), the training batches' own score (where logged), the same questions greedy
    (where scored) and the held-out score (right) per RL step, one line per cell (colour: method, line
    style: seed); the warm start's level dashed, the target dotted."""
    panels = [(f"val/{FITTED_SOURCE}/{metric}", "fitted questions (trained on)")]
    if any(_series(h, f"answer/{metric}") for h in histories.values()):
        panels.append((f"answer/{metric}", "training batches: the same questions, sampled (no target)"))
    if any(_series(h, f"val/{FITTED_GREEDY_SOURCE}/{metric}") for h in histories.values()):
        panels.append((f"val/{FITTED_GREEDY_SOURCE}/{metric}", "fitted questions, greedy alone (no target)"))
    if held:
        panels.append((f"val/{held}/{metric}", f"validation split ({held}, held out)"))
    columns = min(len(panels), 2)  # two panels a row: four side by side are too narrow to read
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for spare in axes.flat[len(panels):]:
        spare.remove()
    methods = sorted({cell.rsplit("_seed", 1)[0] for cell in histories})
    colours = {m: f"C{i}" for i, m in enumerate(methods)}
    for ax, (key, title) in zip(axes.flat[: len(panels)], panels, strict=True):
        start = None
        for cell, history in sorted(histories.items()):
            points = _series(history, key)
            if not points:
                continue
            method, seed = cell.rsplit("_seed", 1)
            ax.plot(*zip(*points, strict=True), marker="o", color=colours[method],
                    linestyle="-" if seed in ("0", "") else "--" if seed == "1" else ":", label=cell)
            start = points[0][1] if points[0][0] == 0 else start
        if start is not None:
            ax.axhline(start, color="grey", linestyle="--", linewidth=1, label="warm start")
            if key.startswith(f"val/{FITTED_SOURCE}/"):
                ax.axhline(start + target, color="grey", linestyle=":", linewidth=1, label=f"warm start + {target:.2f}")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.set_ylabel(metric)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
