"""`make compare` through a real KedroSession (tiny model, test env): the design check, every
method × seed trained and evaluated, the report, MLflow runs per seed, and resume on a rerun."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline.pipelines.compare.nodes import check_design, seed_training

PARAMS = {"methods": ["grpo", "spader"], "seeds": [0, 1], "dataset": "embedded_test", "min_questions": 4}


def _sets(n: int) -> dict:
    frame = pd.DataFrame({"id": [str(i) for i in range(n)], "question": ["q"] * n})
    return {"embedded_test": lambda: frame}


def test_design_needs_two_seeds_two_methods_and_enough_questions():
    assert check_design(_sets(5), PARAMS)["question_ids"] == ["0", "1", "2", "3", "4"]
    with pytest.raises(ValueError, match="at least 2 seeds"):
        check_design(_sets(5), {**PARAMS, "seeds": [0, 0]})
    with pytest.raises(ValueError, match="two different methods"):
        check_design(_sets(5), {**PARAMS, "methods": ["grpo"]})
    with pytest.raises(ValueError, match="has 3 questions"):
        check_design(_sets(3), PARAMS)
    with pytest.raises(ValueError, match="not an evaluation set"):
        check_design(_sets(5), {**PARAMS, "dataset": "nope"})


def test_each_seed_gets_its_own_directory_and_seed_for_both_backends():
    training = {"native": {"seed": 0, "total_steps": 3}, "verl": {"overrides": ["a=1"]}, "output_dir": "x"}
    seeded = seed_training(training, "out/compare", 2)
    assert seeded["output_dir"] == "out/compare/seed2" and seeded["native"] == {"seed": 2, "total_steps": 3}
    assert seeded["verl"]["overrides"] == ["a=1", "data.seed=2", "actor_rollout_ref.actor.data_loader_seed=2"]
    assert training["native"]["seed"] == 0  # the shared settings are not modified


RUNTIME = {
    "compare": {"seeds": [0, 1], "min_questions": 4, "max_questions": 6,
                "bootstrap": {"resamples": 200}, "evaluation": {"trained_models": {"batch_size": 8}}},
    "warm_start": {"reuse": True},
    "training": {"native": {"total_steps": 1}},
}


def _method_runs() -> list:
    experiment = mlflow.get_experiment_by_name("spader-pipeline-test")
    if experiment is None:
        return []
    runs = mlflow.search_runs(experiment_ids=[experiment.experiment_id], output_format="list")
    return [r for r in runs if "method" in r.data.tags and r.info.run_name.split()[0] in ("grpo", "spader")]


@pytest.mark.e2e
@pytest.mark.slow
def test_compare_session_trains_every_seed_reports_and_resumes(kedro_project):
    before = {r.info.run_id for r in _method_runs()}
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=RUNTIME) as session:
        session.run(pipeline_names=["compare"])

    runs = json.loads((kedro_project / "data/07_model_output/compare_runs.json").read_text())
    assert sorted(runs) == ["grpo_seed0", "grpo_seed1", "spader_seed0", "spader_seed1"]
    for run in runs.values():
        assert run["manifest"]["path"].endswith(f"compare/seed{run['seed']}/train_{run['method']}/final")
        assert [h["step"] for h in run["history"]] == [1]
    samples = pd.read_json(kedro_project / "data/07_model_output/compare_eval_samples.jsonl", lines=True)
    assert set(samples["model"]) == {"warm_start", "scripted", *runs}
    assert samples.groupby("model").size().nunique() == 1  # every model on the same questions
    report = (kedro_project / "data/08_reporting/compare_report.md").read_text()
    assert "SPADER vs GRPO" in report and "(paired)" in report and "detectable" in report
    assert (kedro_project / "data/08_reporting/compare_curves.png").stat().st_size > 10_000
    metrics = json.loads((kedro_project / "data/08_reporting/compare_metrics.json").read_text())
    assert {"grpo/recall/mean", "spader/f1/low", "diff/recall/high", "diff/long_tail_recall/detectable"} <= set(metrics)

    created = [r for r in _method_runs() if r.info.run_id not in before]
    assert sorted(r.info.run_name for r in created) == ["grpo seed0", "grpo seed1", "spader seed0", "spader seed1"]
    chain = mlflow.get_run(created[0].data.tags["chain_run_id"])
    assert "compare/diff/recall/mean" in chain.data.metrics

    # A rerun resumes: the warm start and the finished trainings are reused (no new training run).
    warm_weights = next((kedro_project / "data/06_models/warm_start").glob("*.safetensors")).stat().st_mtime_ns
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=RUNTIME) as session:
        session.run(pipeline_names=["compare"])
    assert next((kedro_project / "data/06_models/warm_start").glob("*.safetensors")).stat().st_mtime_ns == warm_weights
    assert len([r for r in _method_runs() if r.info.run_id not in before]) == 4


@pytest.mark.e2e
def test_a_held_out_set_too_small_stops_before_training(kedro_project):
    runtime = {**RUNTIME, "compare": {**RUNTIME["compare"], "min_questions": 100_000}}
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=runtime) as session:
        with pytest.raises(ValueError, match="a paired interval needs at least 100000"):
            session.run(pipeline_names=["compare"])
    assert not (kedro_project / "data/06_models/warm_start").exists()
