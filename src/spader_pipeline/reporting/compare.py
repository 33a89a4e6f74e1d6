"""The report of ``make compare``: per-method scores with confidence intervals, the paired difference
candidate − baseline, the mechanism metrics over steps, and the curves (docs/results.md shows one).

Scores are per held-out question and seed (failed samples score 0): recall and F1 are means over
questions; long-tail recall is hits over the gold entities that occur in fewer than
``compare.long_tail_below`` corpus passages (a micro-average, like ``long_tail_recall/*`` of
docs/metrics.md). Intervals (:mod:`spader_pipeline.evaluation.bootstrap`): the seeds × questions
bootstrap and, beside it, a paired t interval over seed means (df = seeds − 1); every conclusion is
taken from the wider of the two. Each method is also compared with the warm start it started from
(did it learn?), and the design says how many seeds and questions a difference of
``compare.target_difference`` would need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from spader_pipeline.evaluation.bootstrap import (
    DesignNeeds,
    Interval,
    PairedDifference,
    SeedInterval,
    bootstrap_interval,
    design_needs,
    paired_difference,
    paired_t_interval,
    wider,
)
from spader_pipeline.reporting.tables import markdown_table

if TYPE_CHECKING:
    from spader_pipeline.native.config import NativeTrainerConfig

#: Held-out scores compared: name → (numerator, denominator) columns of :func:`question_scores`.
SCORES = {"recall": ("recall", None), "f1": ("f1", None), "long_tail_recall": ("tail_hits", "tail_total")}
#: Per-step training metrics summarised per method (means over steps and seeds).
MECHANISM_KEYS = ("answer/recall", "method_reward/mean", "group/diverse_frac", "group/distinct_query_seqs",
                  "group/distinct_docs", "group/entity_recall_union", "group/entity_recall_mean",
                  "adv/zero_groups", "adv/corr_vs_grpo", "adv/rel_l2_vs_grpo", "adv/zero_frac", "adv/grpo_zero_frac",
                  "rollout/tool_calls")
#: Curves drawn per method and seed over training steps.
CURVES = (("val/{source}/recall", "validation recall (greedy; dashed: warm start)"),
          ("answer/recall", "training answer recall"), ("adv/corr_vs_grpo", "corr(advantages, GRPO's)"),
          ("adv/zero_frac", "share of tokens with advantage 0"), ("rollout/tool_calls", "searches per trajectory"),
          ("group/entity_recall_union", "gold entities retrieved by a group"))


def question_scores(samples: pd.DataFrame, long_tail_below: int) -> pd.DataFrame:
    """One row per model × question: ``recall``, ``f1``, ``tail_hits``/``tail_total`` (failed = 0)."""
    def tail(row: Mapping[str, Any]) -> tuple[float, float]:
        freqs, matched = row.get("corpus_frequency"), row.get("matched_entities")
        if not isinstance(freqs, (list, np.ndarray)) or not isinstance(matched, (list, np.ndarray)):
            return 0.0, 0.0
        rare = np.asarray(freqs) < long_tail_below
        return float(np.asarray(matched, dtype=bool)[rare].sum()), float(rare.sum())

    out = samples[["model", "method", "seed", "id"]].copy()
    ok = samples.get("status", pd.Series("ok", index=samples.index)).fillna("ok").eq("ok")
    for key in ("recall", "f1"):
        out[key] = pd.to_numeric(samples[key], errors="coerce").where(ok, 0.0).fillna(0.0)
    tails = [tail(r) for r in samples.to_dict(orient="records")]
    out["tail_hits"] = [h if good else 0.0 for (h, _), good in zip(tails, ok, strict=True)]
    out["tail_total"] = [t for _, t in tails]
    out["id"] = out["id"].astype(str)
    return out


def score_grid(scores: pd.DataFrame, method: str, seeds: Sequence[int], ids: Sequence[str], column: str) -> np.ndarray:
    """``[S, Q]`` grid of one method's ``column`` (seeds × questions, in the given orders)."""
    sub = scores[scores["method"] == method].pivot_table(index="seed", columns="id", values=column, aggfunc="first")
    missing = [s for s in seeds if s not in sub.index] or [q for q in ids if q not in sub.columns]
    if missing:
        raise ValueError(f"{method}: no held-out scores for {missing[:5]}")
    return sub.loc[list(seeds), list(ids)].to_numpy(dtype=float)


def compare_statistics(design: Mapping[str, Any], scores: pd.DataFrame, stats: Mapping[str, Any]
                       ) -> tuple[dict[str, dict[str, Interval]], dict[str, PairedDifference], dict[str, dict[str, list[float]]]]:
    """Per method and score its interval, per score the paired difference candidate − baseline, and
    per method and score the per-seed values."""
    seeds, ids = design["seeds"], design["question_ids"]
    opts = {"resamples": int(stats.get("resamples", 2000)), "confidence": float(stats.get("confidence", 0.95)),
            "seed": int(stats.get("seed", 0))}
    intervals: dict[str, dict[str, Interval]] = {}
    per_seed: dict[str, dict[str, list[float]]] = {}
    grids: dict[tuple[str, str], tuple[np.ndarray, np.ndarray | None]] = {}
    for method in design["methods"]:
        intervals[method], per_seed[method] = {}, {}
        for name, (num, den) in SCORES.items():
            grid_num = score_grid(scores, method, seeds, ids, num)
            grid_den = score_grid(scores, method, seeds, ids, den) if den else None
            grids[(method, name)] = (grid_num, grid_den)
            intervals[method][name] = bootstrap_interval(grid_num, grid_den, **opts)
            totals = grid_den.sum(axis=1) if grid_den is not None else np.full(len(seeds), len(ids))
            per_seed[method][name] = [float(v) for v in grid_num.sum(axis=1) / np.maximum(totals, 1e-12)]
    baseline, candidate = design["methods"]
    differences = {
        name: paired_difference(grids[(baseline, name)][0], grids[(candidate, name)][0],
                                grids[(baseline, name)][1], grids[(candidate, name)][1], **opts)
        for name in SCORES
    }
    return intervals, differences, per_seed


@dataclass(frozen=True)
class Contrast:
    """``B − A`` with both intervals; ``conclusion`` is the wider one."""

    bootstrap: PairedDifference
    t: SeedInterval

    @property
    def conclusion(self) -> Interval:
        return wider(self.bootstrap, self.t)


def contrasts(design: Mapping[str, Any], scores: pd.DataFrame, stats: Mapping[str, Any]
              ) -> tuple[dict[str, Contrast], dict[str, Contrast], DesignNeeds]:
    """Held-out recall: each method − the warm start, and candidate − baseline, each with the seeds ×
    questions bootstrap and the paired t interval over seed means; and what the design needs to
    detect ``target_difference`` between the methods."""
    seeds, ids = design["seeds"], design["question_ids"]
    opts = {"resamples": int(stats.get("resamples", 2000)), "confidence": float(stats.get("confidence", 0.95)),
            "seed": int(stats.get("seed", 0))}
    grid = {m: score_grid(scores, m, seeds, ids, "recall") for m in design["methods"]}
    warm = scores[scores["method"] == "warm_start"].set_index("id")["recall"]
    missing = [q for q in ids if q not in warm.index]
    if missing:
        raise ValueError(f"warm_start: no held-out scores for {missing[:5]}")
    warm_grid = np.broadcast_to(warm.loc[list(ids)].to_numpy(dtype=float), grid[design["methods"][0]].shape)

    def contrast(a: np.ndarray, b: np.ndarray) -> Contrast:
        return Contrast(paired_difference(a, b, **opts),
                        paired_t_interval(a.mean(axis=1), b.mean(axis=1), confidence=opts["confidence"]))

    learned = {m: contrast(warm_grid, g) for m, g in grid.items()}
    baseline, candidate = design["methods"]
    between = {"recall": contrast(grid[baseline], grid[candidate])}
    needs = design_needs(grid[candidate] - grid[baseline], float(stats.get("target_difference", 0.03)),
                         max_questions=int(stats.get("max_questions", len(ids))), confidence=opts["confidence"])
    return learned, between, needs


def mechanism_table(runs: Mapping[str, Any], methods: Sequence[str]) -> pd.DataFrame:
    """Per method: each :data:`MECHANISM_KEYS` metric averaged over all steps of all seeds."""
    rows = []
    for method in methods:
        # step 0 is the starting policy's validation, not a training step
        history = [h for run in runs.values() if run["method"] == method for h in run["history"] if h.get("step", 1) >= 1]
        row = {"method": method, "steps": len(history)}
        for key in MECHANISM_KEYS:
            values = [float(h[key]) for h in history if key in h and not math.isnan(float(h[key]))]
            row[key] = float(np.mean(values)) if values else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _fmt(interval: Interval) -> str:
    return f"{interval.mean:.3f} [{interval.low:.3f}, {interval.high:.3f}]"


def _ci(interval: Interval) -> str:
    return f"[{interval.low:+.3f}, {interval.high:+.3f}]" if math.isfinite(interval.low) else "–"


def _verdict(c: Contrast, what: str) -> str:
    wide = c.conclusion
    which = "paired t over seed means" if wide is c.t else "seeds × questions bootstrap"
    if not math.isfinite(wide.low):
        return f"{what}: no interval."
    if wide.low > 0:
        return f"{what}: above 0 (the wider interval, {which}, {_ci(wide)}, excludes 0)."
    if wide.high < 0:
        return f"{what}: below 0 (the wider interval, {which}, {_ci(wide)}, excludes 0)."
    return f"{what}: inside the noise (the wider interval, {which}, {_ci(wide)}, contains 0)."


def contrasts_markdown(design: Mapping[str, Any], learned: Mapping[str, Contrast], between: Mapping[str, Contrast],
                       needs: DesignNeeds) -> list[str]:
    """Did each method learn (vs the warm start), and candidate − baseline, with both intervals."""
    baseline, candidate = design["methods"]
    head = ["| contrast (held-out recall) | difference | bootstrap CI | paired t CI (df) | conclusion from |",
            "|---|---|---|---|---|"]

    def row(label: str, c: Contrast) -> str:
        source = "t" if c.conclusion is c.t else "bootstrap"
        return f"| {label} | {c.t.mean:+.3f} | {_ci(c.bootstrap)} | {_ci(c.t)} ({c.t.df}) | {source} |"

    lines = ["## Did the methods learn, and which is better", "", *head]
    lines += [row(f"{m} − warm start", c) for m, c in learned.items()]
    lines += [row(f"{candidate} − {baseline}", between["recall"]), ""]
    lines += [f"- {_verdict(c, f'{m} − warm start')}" for m, c in learned.items()]
    lines += [f"- {_verdict(between['recall'], f'{candidate} − {baseline}')}", ""]
    seeds_now, seeds_max = needs.seeds_at_current_questions, needs.seeds_at_max_questions
    lines.append(
        f"Design: with {len(design['seeds'])} seeds × {len(design['question_ids'])} questions the paired t test detects "
        f"{needs.detectable_now:.3f} (power 0.8). A difference of {needs.target:.3f} needs "
        f"{seeds_now if seeds_now else 'more than 200'} seeds at {len(design['question_ids'])} questions, "
        f"{seeds_max if seeds_max else 'more than 200'} at {needs.max_questions} questions "
        "(from this run's seed-to-seed and question variance).")
    return lines


def report_markdown(design: Mapping[str, Any], intervals, differences, per_seed, mechanisms: pd.DataFrame,
                    warm_start: Mapping[str, float], settings: Mapping[str, Any],
                    contrast_lines: Sequence[str] = ()) -> str:
    """The report: design, scores with intervals, the paired difference in numbers and words, mechanisms."""
    baseline, candidate = design["methods"]
    confidence = next(iter(differences.values())).confidence
    level = f"{confidence:.0%}"
    lines = [
        f"# {candidate.upper()} vs {baseline.upper()}: seeded comparison on `{design['dataset']}`",
        "",
        f"{len(design['question_ids'])} held-out questions × seeds {design['seeds']}, greedy; "
        f"{settings.get('steps', '?')} RL steps of {settings.get('prompts_per_step', '?')} questions × "
        f"{settings.get('group_size', '?')} trajectories per run, one shared warm start. Intervals: {level} "
        "percentile bootstrap over seeds and questions (paired for the difference).",
        "",
        f"| model | {' | '.join(SCORES)} | per seed (recall) |",
        "|---|" + "---|" * (len(SCORES) + 1),
        f"| warm start | {' | '.join(f'{warm_start.get(k, math.nan):.3f}' for k in SCORES)} | |",
    ]
    for method in design["methods"]:
        cells = " | ".join(_fmt(intervals[method][k]) for k in SCORES)
        seeds = ", ".join(f"{v:.3f}" for v in per_seed[method]["recall"])
        lines.append(f"| {method} | {cells} | {seeds} |")
    lines += ["", f"## {candidate} − {baseline} (paired)", "",
              "| score | difference | CI | p(≤ 0) | detectable |", "|---|---|---|---|---|"]
    for name, diff in differences.items():
        lines.append(f"| {name} | {diff.mean:+.3f} | [{diff.low:+.3f}, {diff.high:+.3f}] | {diff.p_not_better:.2f} | "
                     f"{diff.detectable:.3f} |")
    # recall's conclusion is the contrasts section's (the wider interval); the others' the bootstrap's
    lines += ["", *[_in_words(name, diff, candidate, baseline) + (" (bootstrap)" if contrast_lines else "")
                    for name, diff in differences.items() if not (contrast_lines and name == "recall")], "",
              "*detectable*: the smallest true difference this design finds with power 0.8 at the two-sided "
              f"{1 - confidence:.0%} level ((z₁₋α/₂ + z₀.₈) × bootstrap standard error).", "",
              *contrast_lines, "",
              "## Mechanism (means over all training steps and seeds)", "",
              markdown_table(mechanisms), "",
              _mechanism_in_words(mechanisms, candidate)]
    return "\n".join(lines) + "\n"


def _in_words(name: str, diff: PairedDifference, candidate: str, baseline: str) -> str:
    span = f"{diff.confidence:.0%} CI [{diff.low:+.3f}, {diff.high:+.3f}]"
    if math.isnan(diff.low):
        return f"- **{name}**: no interval (no scored questions)."
    if diff.contains_zero:
        return (f"- **{name}**: no detectable difference — the {span} contains 0; differences smaller than "
                f"{diff.detectable:.3f} are below what this design can detect.")
    better = candidate if diff.mean > 0 else baseline
    return f"- **{name}**: {better} is better by {abs(diff.mean):.3f} ({span} excludes 0)."


def _mechanism_in_words(mechanisms: pd.DataFrame, candidate: str) -> str:
    row = mechanisms.set_index("method").loc[candidate]
    corr = row.get("adv/corr_vs_grpo", math.nan)
    if math.isnan(corr):
        agreement = f"{candidate}'s advantages could not be correlated with GRPO's (no step where both vary)"
    else:
        verdict = "differ from" if corr < 0.9 else "nearly equal"
        agreement = (f"{candidate}'s token advantages {verdict} GRPO's on the same batches (mean correlation "
                     f"{corr:.2f} over the steps where both vary, relative L2 distance "
                     f"{row.get('adv/rel_l2_vs_grpo', math.nan):.2f})")
    return (f"{agreement}; GRPO gives no gradient to {row.get('adv/grpo_zero_frac', math.nan):.0%} of the model "
            f"tokens, {candidate} to {row.get('adv/zero_frac', math.nan):.0%}; groups with ≥ 2 distinct query "
            f"sequences: {row.get('group/diverse_frac', math.nan):.2f} of groups.")


def curves_figure(runs: Mapping[str, Any], design: Mapping[str, Any], intervals, per_seed,
                  warm_start_recall: float = math.nan) -> plt.Figure:
    """Per-seed validation and training curves per method (one colour per method, one line per seed)
    and the held-out recall per method with its interval and per-seed points; the warm start's level
    is the dashed line in the validation and held-out panels."""
    source = next((k.split("/")[1] for run in runs.values() for h in run["history"] for k in h
                   if k.startswith("val/") and k.endswith("/recall")), "embedded")
    panels = len(CURVES) + 1
    fig, grid = plt.subplots(2, (panels + 1) // 2, figsize=(4.4 * ((panels + 1) // 2), 7.2), constrained_layout=True)
    axes = list(grid.flat)
    colours = dict(zip(design["methods"], ("tab:blue", "tab:orange"), strict=True))
    styles = ("-", "--", ":", "-.")
    for ax, (key, title) in zip(axes, CURVES, strict=False):
        key = key.format(source=source)
        if key.startswith("val/"):
            start = [h[key] for run in runs.values() for h in run["history"] if h.get("step") == 0 and key in h]
            if start:
                ax.axhline(float(np.mean(start)), color="0.4", linestyle=(0, (4, 3)), linewidth=1.2)
        for run in runs.values():
            points = [(h["step"], h[key]) for h in run["history"] if key in h and not math.isnan(float(h[key]))]
            if points:
                x, y = zip(*points, strict=True)
                ax.plot(x, y, marker="o", ms=3, color=colours[run["method"]], alpha=0.8,
                        linestyle=styles[design["seeds"].index(run["seed"]) % len(styles)]
                        if run["seed"] in design["seeds"] else "-",
                        label=f"{run['method']} seed{run['seed']}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    next((ax for ax in axes if ax.get_legend_handles_labels()[0]), axes[0]).legend(fontsize=7)
    for ax in axes[panels:]:
        ax.set_visible(False)
    ax = axes[panels - 1]
    for i, method in enumerate(design["methods"]):
        interval = intervals[method]["recall"]
        ax.errorbar([i], [interval.mean], yerr=[[interval.mean - interval.low], [interval.high - interval.mean]],
                    fmt="s", color=colours[method], capsize=6, ms=8)
        ax.scatter([i + 0.15] * len(per_seed[method]["recall"]), per_seed[method]["recall"], color=colours[method],
                   s=14, alpha=0.7)
    if math.isfinite(warm_start_recall):
        ax.axhline(warm_start_recall, color="0.4", linestyle=(0, (4, 3)), linewidth=1.2,
                   label=f"warm start {warm_start_recall:.3f}")
        ax.legend(fontsize=7)
    ax.set_xticks(range(len(design["methods"])), design["methods"])
    ax.set_xlim(-0.5, len(design["methods"]) - 0.5)
    ax.set_title(f"held-out recall ({len(design['question_ids'])} q., CI; dots: seeds)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return fig


def build_report(design: Mapping[str, Any], runs: Mapping[str, Any], samples: pd.DataFrame, compare: Mapping[str, Any],
                 trainer: NativeTrainerConfig) -> tuple[str, plt.Figure, dict[str, float]]:
    """Markdown, figure and flat metrics (``<method>/<score>/mean``, ``diff/<score>/low``, ...);
    ``trainer``: the cells' shared trainer settings (their RL budget in the report's design line)."""
    scores = question_scores(samples, int(compare.get("long_tail_below", 5)))
    intervals, differences, per_seed = compare_statistics(design, scores, compare.get("bootstrap", {}))
    warm = scores[scores["method"] == "warm_start"]
    warm_start = {"recall": warm["recall"].mean(), "f1": warm["f1"].mean(),
                  "long_tail_recall": warm["tail_hits"].sum() / max(warm["tail_total"].sum(), 1)}
    mechanisms = mechanism_table(runs, design["methods"])
    settings = {"steps": trainer.total_steps, "prompts_per_step": trainer.prompts_per_step,
                "group_size": trainer.group_size}
    learned, between, needs = contrasts(design, scores, {**compare.get("bootstrap", {}),
                                                         "target_difference": compare.get("target_difference", 0.03),
                                                         "max_questions": compare.get("max_design_questions", 240)})
    text = report_markdown(design, intervals, differences, per_seed, mechanisms, warm_start, settings,
                           contrasts_markdown(design, learned, between, needs))
    metrics = {f"{m}/{k}/{part}": float(getattr(iv, part)) for m, d in intervals.items() for k, iv in d.items()
               for part in ("mean", "low", "high")}
    metrics.update({f"diff/{k}/{part}": float(getattr(d, part)) for k, d in differences.items()
                    for part in ("mean", "low", "high", "detectable", "p_not_better")})
    metrics.update({f"warm_start/{k}": float(v) for k, v in warm_start.items()})
    for label, c in [*((f"{m}_vs_warm_start", c) for m, c in learned.items()), ("diff", between["recall"])]:
        metrics.update({f"{label}/recall/t_{part}": float(getattr(c.t, part)) for part in ("mean", "low", "high")})
        metrics.update({f"{label}/recall/boot_{part}": float(getattr(c.bootstrap, part)) for part in ("low", "high")})
    metrics["design/detectable_t"] = float(needs.detectable_now)
    metrics["design/seeds_needed"] = float(needs.seeds_at_current_questions or math.nan)
    return text, curves_figure(runs, design, intervals, per_seed, float(warm_start["recall"])), metrics
