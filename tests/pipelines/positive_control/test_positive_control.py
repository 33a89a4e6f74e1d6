"""``make positive-control``: the fitted set, the report, and the pipeline's own nodes through a real
KedroSession (the cells' training is the training stage's ``train_policy``, run by the compare tests)."""

from __future__ import annotations

import dataclasses
import json

import mlflow
import pandas as pd
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline.pipelines.positive_control import create_pipeline
from spader_pipeline.pipelines.positive_control.nodes import cell_name, cell_settings, fitted_set
from spader_pipeline.pipelines.positive_control.pipeline import CELLS
from spader_pipeline.reporting.positive_control import build_report
from spader_pipeline.training import TrainingSettings

DESIGN = {"questions": 2, "question_seed": 0, "validation_questions": 2, "target_gain": 0.2}


def _verl(n: int, split: str) -> pd.DataFrame:
    return pd.DataFrame([
        {"prompt": [], "data_source": "embedded", "agent_name": "spader_search", "ability": "multi_answer_search",
         "reward_model": {"style": "rule", "ground_truth": [[f"{split}{i}"]]},
         "extra_info": {"index": i, "id": f"{split}{i}", "split": split, "question": f"Which {split} {i}?"}}
        for i in range(n)
    ])


def _history(fitted: list[float], validation: list[float]) -> list[dict[str, float]]:
    steps = [0, 2, 4][: len(fitted)]  # F1 a tenth below recall: the report reads the design's metric
    return [{"step": s, "val/fitted/recall": f, "val/embedded/recall": v, "val/fitted/f1": f - 0.1,
             "val/embedded/f1": v - 0.1} for s, f, v in zip(steps, fitted, validation, strict=True)]


def test_the_fitted_set_is_one_draw_for_every_cell_scored_under_its_own_source():
    train, validation = fitted_set(_verl(10, "train"), _verl(5, "validation"), DESIGN)
    again, _ = fitted_set(_verl(10, "train"), _verl(5, "validation"), DESIGN)
    assert len(train) == 2 and train.equals(again)
    assert list(validation["data_source"]) == ["fitted", "fitted", "embedded", "embedded"]
    assert [e["id"] for e in validation["extra_info"]] == [*(e["id"] for e in train["extra_info"]),
                                                            "validation0", "validation1"]
    with pytest.raises(ValueError, match="positive_control.questions=11"):
        fitted_set(_verl(10, "train"), _verl(5, "validation"), {**DESIGN, "questions": 11})


def test_a_fitted_set_named_by_id_keeps_its_order_and_refuses_an_unknown_id():
    design = {**DESIGN, "question_ids": ["train7", "train2"]}
    train, validation = fitted_set(_verl(10, "train"), _verl(5, "validation"), design)
    assert [e["id"] for e in train["extra_info"]] == ["train7", "train2"]
    assert list(validation["data_source"]) == ["fitted", "fitted", "embedded", "embedded"]
    with pytest.raises(ValueError, match=r"\['validation1'\]"):
        fitted_set(_verl(10, "train"), _verl(5, "validation"), {**design, "question_ids": ["train1", "validation1"]})
    with pytest.raises(ValueError, match="duplicates"):
        fitted_set(_verl(10, "train"), _verl(5, "validation"), {**design, "question_ids": ["train1", "train1"]})


def test_a_cell_trains_on_every_fitted_question_and_validates_every_row():
    validation = {"every": 4, "max_questions": 16, "batch_size": {"fitted": 1}}
    training = {"native": {"seed": 0}, "max_train_questions": 40, "validation": validation}
    settings = cell_settings(training, "out", seed=1)
    assert settings.seed == 1 and settings.output_dir == "out/seed1" and settings.max_train_questions is None
    assert settings.validation == dataclasses.replace(TrainingSettings.from_mapping(training).validation,
                                                      max_questions=None)  # each fitted question still alone


def test_the_report_counts_the_cells_that_reach_the_target():
    histories = {"fit_grpo_seed0": _history([0.5, 0.6, 0.75], [0.1, 0.1, 0.12]),
                 "fit_spader_seed0": _history([0.5, 0.55, 0.6], [0.1, 0.2, 0.05])}
    text, figure, metrics = build_report(histories, DESIGN)
    assert "**1 of 2 cells** gained at least +0.20" in text and "0.500 → 0.750" in text
    assert metrics["cells_reached"] == 1 and metrics["fit_grpo_seed0/gain"] == pytest.approx(0.25)
    assert metrics["fit_spader_seed0/validation_gain"] == pytest.approx(-0.05)
    assert len(figure.axes) == 2
    exact = {"fit_grpo_seed0": _history([0.5, 0.6, 0.7], [0.1, 0.1, 0.1])}  # 0.7 - 0.5 is 0.19999999999999996
    assert build_report(exact, DESIGN)[2]["cells_reached"] == 1
    named, _, _ = build_report(histories, {**DESIGN, "question_ids": ["a", "b", "c"]})
    assert "on the same 3 training questions" in named
    with pytest.raises(ValueError, match="not at the warm start"):
        build_report({"fit_grpo_seed0": _history([0.5, 0.6], [0.1, 0.1])[1:]}, DESIGN)


def test_the_verdict_needs_every_cell_and_the_mean_over_cells_with_its_interval_above_zero():
    """Every cell at ``target_gain``, and the mean over cells at ``target_mean_gain`` with the lower end of
    the wider of its t interval over cells and its bootstrap over cells above 0; the greedy curve of the
    same questions is shown beside, with no target; the grain one trajectory moves a score is stated."""
    from spader_pipeline.reporting.positive_control import mean_gain_interval, verdict

    design = {**DESIGN, "target_gain": 0.05, "target_mean_gain": 0.1}

    def cells(gains):
        return {f"fit_grpo_seed{k}": [{**row, "val/fitted_greedy/recall": 0.2 + row["step"] / 10}
                                      for row in _history([0.3, 0.3 + g / 2, 0.3 + g], [0.1, 0.1, 0.1])]
                for k, g in enumerate(gains)}

    text, figure, metrics = build_report(cells([0.15, 0.2, 0.1, 0.25]), design, grain=0.05)
    assert metrics["learns"] == 1.0 and metrics["mean_gain"] == pytest.approx(0.175)
    assert 0 < metrics["mean_gain_low"] < 0.175 < metrics["mean_gain_high"]
    assert "**the loop learns**" in text and "at most 0.050" in text and "0.200 → 0.600" in text
    assert len(figure.axes) == 3 and metrics["fit_grpo_seed0/greedy_gain"] == pytest.approx(0.4)
    one_short = build_report(cells([0.15, 0.2, 0.04, 0.25]), design)[2]
    assert one_short["cells_reached"] == 3 and one_short["learns"] == 0.0
    spread = build_report(cells([0.06, 0.5, 0.06, 0.06]), design)[2]  # every cell, mean 0.17, but one cell carries it
    assert spread["cells_reached"] == 4 and spread["mean_gain_low"] < 0 and spread["learns"] == 0.0
    interval = mean_gain_interval([0.06, 0.5, 0.06, 0.06])
    assert interval.high - interval.low > 0.5  # the t interval over 4 cells (df 3), wider than the bootstrap's
    assert verdict(cell_outcomes_of(cells([0.2, 0.2]), design), design)["mean"].low == pytest.approx(0.2)


def cell_outcomes_of(histories, design):
    from spader_pipeline.reporting.positive_control import cell_outcomes

    return cell_outcomes(histories, float(design["target_gain"]))


def test_the_fitted_questions_are_scored_greedy_beside_when_the_design_asks():
    _, validation = fitted_set(_verl(10, "train"), _verl(5, "validation"), {**DESIGN, "greedy_beside": True})
    assert list(validation["data_source"]) == ["fitted", "fitted", "fitted_greedy", "fitted_greedy", "embedded",
                                               "embedded"]
    from spader_pipeline.pipelines.positive_control.nodes import fitted_grain

    training = {"validation": {"trajectories": {"fitted": 5}}}
    assert fitted_grain(DESIGN, training) == pytest.approx(1 / 10)
    assert fitted_grain({**DESIGN, "question_ids": ["a", "b", "c", "d"]}, {}) == pytest.approx(1 / 4)


def test_the_cells_are_two_methods_by_two_seeds_each_in_its_namespace():
    pipeline = create_pipeline()
    assert sorted({n.namespace for n in pipeline.nodes if n.namespace}) == sorted(cell_name(m, s) for m, s in CELLS)
    assert {m for m, _ in CELLS} == {"grpo", "spader"} and {s for _, s in CELLS} == {0, 1}
    assert "validate_warm_start" not in {n.name for n in pipeline.nodes}  # step 0 is on the fitted set


def test_the_fitted_set_and_the_report_run_through_a_kedro_session(kedro_project):
    verl = kedro_project / "data" / "05_model_input" / "verl"
    verl.mkdir(parents=True)
    _verl(10, "train").to_parquet(verl / "train.parquet")
    _verl(5, "validation").to_parquet(verl / "validation.parquet")
    for k, (method, seed) in enumerate(CELLS):
        path = kedro_project / "data" / "07_model_output" / cell_name(method, seed) / "training_history.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_history([0.4, 0.5, 0.65 + 0.05 * k], [0.1, 0.1, 0.1])))
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["positive_control"], node_names=["fitted_set", "positive_control_report"])
    data = kedro_project / "data"
    # conf/base's design: 4 fitted questions, the same greedy beside, then the validation split's first 10 (of 5)
    assert len(pd.read_parquet(data / "05_model_input/positive_control/fitted_validation.parquet")) == 4 + 4 + 5
    report = (data / "08_reporting/positive_control_report.md").read_text()
    assert "**4 of 4 cells** gained at least +0.01 fitted f1" in report and "**the loop learns**" in report
    assert "| fitted f1: warm start → last |" in report and "0.300 → 0.550" in report
    assert "scored on them from step 0 (each question's greedy trajectory)" in report  # conf/test's gauge, named
    assert (data / "08_reporting/positive_control_curves.png").stat().st_size > 0
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                filter_string="metrics.`positive_control/cells_reached` = 4")
    assert run.data.metrics["positive_control/min_gain"] == pytest.approx(0.25)


def test_the_selection_script_ranks_by_the_spread_of_sampled_recall_not_by_greedy():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "select_fitted_set.py"
    spec = importlib.util.spec_from_file_location("select_fitted_set", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = [{"id": "tied", "sampled": [0.2] * 8, "greedy": 0.0},           # one recall for all: no signal
            {"id": "spread", "sampled": [0.0, 0.6] * 4, "greedy": 0.6},
            {"id": "less", "sampled": [0.2, 0.4] * 4, "greedy": 0.0},
            {"id": "less_higher", "sampled": [0.4, 0.6] * 4, "greedy": 1.0}]
    assert [r["id"] for r in script.rank_by_spread(rows)] == ["spread", "less_higher", "less", "tied"]


def test_the_report_names_the_gauge_its_scores_come_from():
    from spader_pipeline.pipelines.positive_control.nodes import fitted_gauge

    sampled = {"validation": {"trajectories": {"fitted": 12}, "seed": 3}, "native": {"temperature": 0.7}}
    assert fitted_gauge(sampled) == ("each question's mean over 12 trajectories sampled at T = 0.7 from validation "
                                     "seed 3's draws, the same for every cell")
    colder = {**sampled, "validation": {**sampled["validation"], "temperature": 0.3}}
    assert "sampled at T = 0.3" in fitted_gauge(colder)  # the validation's own temperature, where it names one
    assert fitted_gauge({}) == "each question's greedy trajectory"


def test_the_training_batches_curve_is_reported_beside_the_gauge_without_a_target():
    from spader_pipeline.reporting.positive_control import training_thirds

    def history(train_f1):
        steps = [{"step": k + 1, "answer/f1": v} for k, v in enumerate(train_f1)]
        steps[-1]["val/fitted/f1"] = 0.5  # the gauge, flat
        return [{"step": 0, "val/fitted/f1": 0.5}, *steps]

    # six steps: the first two (0.4, 0.5) against the last two (0.6, 0.8)
    assert training_thirds(history([0.4, 0.5, 0.1, 0.9, 0.6, 0.8]), "f1") == pytest.approx(
        {"training_start": 0.45, "training_end": 0.7})
    cells = {f"fit_grpo_seed{k}": history([0.4, 0.4, 0.5, 0.5, 0.6, 0.6 + 0.1 * k]) for k in range(3)}
    text, figure, metrics = build_report(cells, {**DESIGN, "metric": "f1", "target_gain": 0.01})
    assert "**not shown**" in text  # the gauge did not move: the training curve carries no verdict
    assert metrics["fit_grpo_seed2/training_rise"] == pytest.approx((0.6 + 0.8) / 2 - 0.4)
    assert metrics["training_rise"] == pytest.approx((0.2 + 0.25 + 0.3) / 3)
    assert "3 of 3 cells rising (the loop's learning curve; no target)" in text
    assert "| 0.400 → 0.600 |" in text
    assert [ax.get_title().split(":")[0] for ax in figure.axes] == ["fitted questions (trained on)", "training batches"]


def test_the_report_shows_what_each_cell_was_rewarded_for_beside_its_f1():
    """SPADER optimises F1 plus its exploration term: the mechanism table puts each cell's own reward, its
    exploration part and the retrieved gold answers beside the gauge (no target), a column left ``—`` for a
    cell that does not log it."""
    def history(reward, discovery=None):
        steps = [{"step": k + 1, "method_reward/mean": r, "retrieval/recall": 0.7, "policy/entropy": 0.1}
                 for k, r in enumerate(reward)]
        if discovery is not None:
            for step, d in zip(steps, discovery, strict=True):
                step["method_reward/discovery_mean"] = d
        return [{"step": 0, "val/fitted/f1": 0.5}, *steps, {"step": len(reward), "val/fitted/f1": 0.5}]

    cells = {"fit_grpo_seed0": history([0.4, 0.5, 0.6]), "fit_spader_seed0": history([1.5, 1.6, 1.2], [1.1, 1.2, 0.8])}
    text, _, metrics = build_report(cells, {**DESIGN, "metric": "f1", "target_gain": 0.01})
    assert "What each cell was rewarded for" in text
    assert "| fit_grpo_seed0 | 0.400 → 0.600 | — | 0.700 → 0.700 | 0.100 → 0.100 |" in text
    assert "| fit_spader_seed0 | 1.500 → 1.200 | 1.100 → 0.800 |" in text
    assert metrics["fit_grpo_seed0/reward_rise"] == pytest.approx(0.2)
    assert metrics["fit_spader_seed0/reward_rise"] == pytest.approx(-0.3)
    both = build_report(cells, {**DESIGN, "metric": "f1", "target_gain": 0.01},
                        trainers={"fit_grpo_seed0": "native", "fit_spader_seed0": "verl"})[0]
    assert "| fit_spader_seed0 | verl | 1.500 → 1.200 |" in both  # a trainer column, as in the verdict's table
    bare = {"fit_grpo_seed0": [{"step": 0, "val/fitted/f1": 0.5}, {"step": 2, "val/fitted/f1": 0.6}]}
    assert "What each cell was rewarded for" not in build_report(bare, {**DESIGN, "metric": "f1"})[0]
