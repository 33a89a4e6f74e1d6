"""The compare report from synthetic per-question records: intervals, the paired difference in
numbers and words, and the mechanism summary."""

import numpy as np
import pandas as pd

from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.reporting.compare import build_report, question_scores


def _samples(shift: float, seeds=(0, 1, 2), n=60, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    hardness = rng.random(n)
    rows = [{"model": "warm_start", "method": "warm_start", "seed": -1, "id": str(q), "status": "ok",
             "recall": hardness[q] * 0.5, "f1": hardness[q] * 0.4, "matched_entities": [True, False],
             "corpus_frequency": [1, 30]} for q in range(n)]
    for method, delta in (("grpo", 0.0), ("spader", shift)):
        for s in seeds:
            for q in range(n):
                value = float(np.clip(hardness[q] * 0.6 + delta + 0.02 * rng.standard_normal(), 0, 1))
                rows.append({"model": f"{method}_seed{s}", "method": method, "seed": s, "id": str(q), "status": "ok",
                             "recall": value, "f1": value * 0.9, "matched_entities": [value > 0.5, True],
                             "corpus_frequency": [2, 40]})
    return pd.DataFrame(rows)


def _runs(seeds=(0, 1, 2)) -> dict:
    return {f"{m}_seed{s}": {"method": m, "seed": s, "history": [
        {"step": 1, "answer/recall": 0.1, "group/diverse_frac": 1.0, "adv/corr_vs_grpo": 1.0 if m == "grpo" else 0.4,
         "adv/rel_l2_vs_grpo": 0.0 if m == "grpo" else 1.1, "rollout/tool_calls": 3.5}]}
        for m in ("grpo", "spader") for s in seeds}


DESIGN = {"methods": ["grpo", "spader"], "seeds": [0, 1, 2], "dataset": "embedded_test",
          "question_ids": [str(q) for q in range(60)]}
COMPARE = {"long_tail_below": 5, "bootstrap": {"resamples": 300}}


def test_a_clear_gain_is_reported_as_one():
    text, figure, metrics = build_report(DESIGN, _runs(), _samples(0.1), COMPARE, NativeTrainerConfig(total_steps=1))
    assert metrics["diff/recall/low"] > 0 and metrics["diff/recall/mean"] > 0.05
    assert "spader − grpo: above 0" in text and "excludes 0" in text
    assert "**f1**: spader is better by" in text
    # each method learned from the warm start (hardness·0.5 → hardness·0.6): both intervals above 0
    assert metrics["spader_vs_warm_start/recall/t_low"] > 0 and metrics["grpo_vs_warm_start/recall/boot_low"] > 0
    assert "spader − warm start: above 0" in text
    assert "differ from GRPO's" in text  # the mechanism: corr 0.4 < 0.9
    assert figure.axes and metrics["spader/recall/low"] <= metrics["spader/recall/mean"] <= metrics["spader/recall/high"]


def test_no_difference_is_said_in_words_with_the_detectable_size():
    text, _, metrics = build_report(DESIGN, _runs(), _samples(0.0), COMPARE, NativeTrainerConfig())
    assert metrics["diff/recall/low"] <= 0 <= metrics["diff/recall/high"]
    assert "spader − grpo: inside the noise" in text and "contains 0" in text
    assert "**f1**: no detectable difference" in text
    # three seeds: the paired t interval over seed means is the wider one, and the conclusion is drawn from it
    assert metrics["diff/recall/t_high"] - metrics["diff/recall/t_low"] >= \
        metrics["diff/recall/boot_high"] - metrics["diff/recall/boot_low"]
    assert "conclusion from" in text and "Design: with 3 seeds × 60 questions" in text
    assert 0 < metrics["diff/recall/detectable"] < 0.05


def test_long_tail_counts_only_rare_entities_and_failures_score_zero():
    frame = pd.DataFrame([
        {"model": "a", "method": "grpo", "seed": 0, "id": "1", "status": "ok", "recall": 1.0, "f1": 1.0,
         "matched_entities": [True, True, False], "corpus_frequency": [1, 10, 3]},
        {"model": "a", "method": "grpo", "seed": 0, "id": "2", "status": "failed", "recall": 0.7, "f1": 0.7,
         "matched_entities": [True], "corpus_frequency": [2]},
    ])
    scores = question_scores(frame, long_tail_below=5)
    assert scores["tail_hits"].tolist() == [1.0, 0.0] and scores["tail_total"].tolist() == [2.0, 1.0]
    assert scores["recall"].tolist() == [1.0, 0.0]


def test_the_figure_draws_validation_curves_and_the_warm_start_level():
    runs = _runs()
    for run in runs.values():
        run["history"] = [{"step": 0, "val/embedded/recall": 0.2}, *run["history"],
                          {"step": 2, "val/embedded/recall": 0.25}]
    _, figure, _ = build_report(DESIGN, runs, _samples(0.0), COMPARE, NativeTrainerConfig())
    validation = figure.axes[0]
    assert "validation recall" in validation.get_title()
    assert any(np.allclose(line.get_ydata(), 0.2) and len(line.get_ydata()) == 2 for line in validation.get_lines())  # the warm start's level
    held_out = [ax for ax in figure.axes if ax.get_title().startswith("held-out recall")][0]
    assert any(line.get_label().startswith("warm start") for line in held_out.get_lines())
