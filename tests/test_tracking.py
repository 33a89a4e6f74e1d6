"""MLflow run layout on a real (SQLite) store: the experiment kind tag, a chain run named for what
ran, one top-level run per method's training (linked to the chain run by tags, or adopted),
held-out scores on the training run, failures recorded, checkpoints as MLflow models."""

from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace

import mlflow
import pytest
from kedro.pipeline import Pipeline

from spader_pipeline import tracking
from spader_pipeline.hooks import MlflowTrackingHooks, lone_method_node
from spader_pipeline.pipelines import positive_control, training


@pytest.fixture
def experiment(tmp_path):
    name = f"exp-{tmp_path.name}"
    experiment_id = tracking.ensure_experiment(name, tmp_path / "artifacts")
    mlflow.set_experiment(experiment_id=experiment_id)
    yield experiment_id
    while mlflow.active_run() is not None:
        mlflow.end_run()


def test_experiment_is_created_as_and_upgraded_to_a_model_training_experiment(tmp_path):
    new = tracking.ensure_experiment(f"new-{tmp_path.name}", tmp_path / "a")
    assert mlflow.MlflowClient().get_experiment(new).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    old = mlflow.MlflowClient().create_experiment(f"old-{tmp_path.name}")  # e.g. made by an older version
    assert tracking.EXPERIMENT_KIND_TAG not in mlflow.MlflowClient().get_experiment(old).tags
    assert tracking.ensure_experiment(f"old-{tmp_path.name}") == old
    assert mlflow.MlflowClient().get_experiment(old).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_a_job_that_loses_the_race_to_create_the_experiment_uses_the_winners(tmp_path, monkeypatch):
    # Two jobs started together (a comparison's cells) both look the experiment up before either
    # creates it: the second creation fails in the store and must fall back to the first job's.
    name = f"race-{tmp_path.name}"
    lookup = mlflow.MlflowClient.get_experiment_by_name
    calls = []

    def other_job_creates_it_after_our_lookup(client, wanted):
        calls.append(wanted)
        found = lookup(client, wanted)
        if len(calls) == 1:
            assert found is None
            mlflow.MlflowClient().create_experiment(wanted)  # the other job wins
        return found

    monkeypatch.setattr(mlflow.MlflowClient, "get_experiment_by_name", other_job_creates_it_after_our_lookup)
    experiment_id = tracking.ensure_experiment(name, tmp_path / "artifacts")
    monkeypatch.undo()
    assert experiment_id == mlflow.MlflowClient().get_experiment_by_name(name).experiment_id
    assert mlflow.MlflowClient().get_experiment(experiment_id).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_the_chain_run_is_named_for_what_ran():
    when = datetime(2026, 11, 24, 21, 40, 5)
    assert tracking.chain_run_name("__default__", "local", when) == "full chain · env local · 2026-11-24 21:40"
    assert tracking.chain_run_name("evaluate", "long", when) == "pipeline evaluate · env long · 2026-11-24 21:40"


def test_comparable_metrics_are_logged_first_and_the_methods_return_last():
    values = {"method_reward/mean": 1.0, "adv/std": 2.0, "retrieval/recall": 3.0, "answer/f1": 4.0, "answer/recall": 5.0}
    assert list(tracking.comparable_first(values)) == [
        "answer/recall", "answer/f1", "retrieval/recall", "adv/std", "method_reward/mean"]


def test_method_runs_are_top_level_runs_linked_to_the_chain_run_with_shared_keys(experiment):
    with mlflow.start_run(run_name="full chain · env local", tags={"git.commit": "abc"}) as parent:
        ids = {}
        for method, params in (("grpo", {"reward": {"enable_exploration": False}}),
                               ("spader", {"reward": {"enable_exploration": True, "alpha": 1.0}})):
            with tracking.method_run(f"{method} seed0", {"method": method, "seed": 0}, {"method": method, **params}) as rid:
                ids[method] = rid
                assert mlflow.active_run().info.run_id == rid
                tracking.log_metrics({"method_reward/mean": 0.5}, step=1)
            assert mlflow.active_run().info.run_id == parent.info.run_id  # the chain run is active again
    client = mlflow.MlflowClient()
    for method, rid in ids.items():
        run = client.get_run(rid)
        assert "mlflow.parentRunId" not in run.data.tags  # top level: the runs table lists it unexpanded
        assert run.data.tags[tracking.CHAIN_RUN_TAG] == parent.info.run_id
        assert run.data.tags[tracking.CHAIN_TAG] == "full chain · env local" and run.data.tags["git.commit"] == "abc"
        assert run.info.run_name == f"{method} seed0" and run.info.status == "FINISHED"
        assert run.info.experiment_id == experiment
        assert run.data.tags["method"] == method and run.data.params["method"] == method
        assert "method_reward/mean" in run.data.metrics
    assert client.get_run(ids["grpo"]).data.params["reward.enable_exploration"] == "False"
    assert client.get_run(ids["spader"]).data.params["reward.enable_exploration"] == "True"
    assert client.get_run(parent.info.run_id).data.metrics == {}  # nothing leaks into the chain run
    linked = mlflow.search_runs([experiment], f"tags.chain_run_id = '{parent.info.run_id}'", output_format="list")
    assert {r.info.run_id for r in linked} == set(ids.values())  # the UI's search box finds a chain's runs


def test_a_run_linked_from_a_linked_run_joins_the_same_chain(experiment):
    with mlflow.start_run() as chain, tracking.linked_run("grpo seed0", {}), tracking.linked_run("evaluate:x:y", {}) as rid:
        pass
    assert mlflow.get_run(rid).data.tags[tracking.CHAIN_RUN_TAG] == chain.info.run_id


def test_held_out_scores_are_copied_onto_the_training_run(experiment):
    with mlflow.start_run():
        with tracking.method_run("spader seed0", {"method": "spader"}, {}) as rid:
            pass
        with tracking.linked_run("evaluate:spader:test", {"training_run_id": rid}):
            tracking.log_heldout(rid, "test", {"recall": 0.5, "f1": 0.25, "num_turns": 3.0, "seen_recall": float("nan")})
        tracking.log_heldout("0" * 32, "test", {"recall": 1.0})  # trained against another store: skipped
    assert mlflow.get_run(rid).data.metrics == {"heldout/test/recall": 0.5, "heldout/test/f1": 0.25}


def test_a_lone_method_pipeline_adopts_the_kedro_run(experiment):
    assert lone_method_node(training.method_pipeline("grpo")).name == "train_grpo.train_policy"
    assert lone_method_node(training.create_pipeline()) is None
    assert lone_method_node(Pipeline([])) is None
    with mlflow.start_run(run_name="train_grpo", tags={tracking.ADOPT_TAG: "true"}) as top:
        with tracking.method_run("grpo seed0", {"method": "grpo"}, {"method": "grpo"}) as rid:
            assert rid == top.info.run_id
            assert mlflow.active_run().info.run_id == top.info.run_id
    run = mlflow.get_run(top.info.run_id)
    assert run.info.run_name == "grpo seed0" and "mlflow.parentRunId" not in run.data.tags
    assert tracking.ADOPT_TAG not in run.data.tags and run.data.params["method"] == "grpo"


def test_a_cell_alone_adopts_the_kedro_run_and_a_grid_nests_its_jobs_runs_under_the_grid_run(tmp_path, monkeypatch):
    """A cell's job (``--namespaces fit_grpo_seed0``) is the cell's training run; in a grid (the grid
    run's id handed over in the environment) every job's run is a child of the grid run, tagged with its
    part, without the parameters the grid run holds; a job whose process died is ended at the end."""
    grid_pipeline = positive_control.create_pipeline()
    cell = grid_pipeline.only_nodes_with_namespaces(["fit_grpo_seed0"])
    assert lone_method_node(cell).name == "fit_grpo_seed0.train_policy"
    assert lone_method_node(grid_pipeline) is None
    config = {"experiment": f"grid-{tmp_path.name}", "artifact_dir": "artifacts"}
    hooks = MlflowTrackingHooks()
    hooks.after_context_created(SimpleNamespace(project_path=tmp_path, env="positive_control", params={"training": {}},
                                                config_loader={"mlflow": config}))
    tracking.use_experiment(config, tmp_path)  # what the grid's driver does
    with mlflow.start_run(run_name=tracking.grid_run_name("positive_control", "positive_control")) as grid:
        pass
    monkeypatch.setenv(tracking.GRID_RUN_ENV, grid.info.run_id)
    ran = {}
    for part, pipeline in (("shared", grid_pipeline.only_nodes("fitted_set")), ("cell", cell), ("dead", cell)):
        hooks.before_pipeline_run({"pipeline_name": "positive_control"}, pipeline, None)
        ran[part] = mlflow.active_run().info.run_id
        if part == "dead":  # its process is killed: nothing ends its run
            mlflow.end_run("RUNNING")
            continue
        if part == "cell":
            with tracking.method_run("positive control grpo seed0", {"method": "grpo"}, {"seed": 0}) as rid:
                assert rid == ran["cell"]
        hooks.after_pipeline_run({}, None, None)
    runs = {part: mlflow.get_run(rid) for part, rid in ran.items()}
    assert all(r.data.tags["mlflow.parentRunId"] == grid.info.run_id for r in runs.values())
    assert runs["shared"].info.run_name.startswith("shared part of positive_control · env positive_control · ")
    assert runs["shared"].data.tags[tracking.GRID_JOB_TAG] == "shared part" and not runs["shared"].data.params
    assert runs["cell"].info.run_name == "positive control grpo seed0" and runs["cell"].data.params == {"seed": "0"}
    assert runs["cell"].data.tags[tracking.GRID_JOB_TAG] == "fit_grpo_seed0"
    assert tracking.end_unfinished_children(grid.info.run_id) == [runs["dead"].info.run_name]
    assert mlflow.get_run(ran["dead"]).info.status == "KILLED"
    assert mlflow.get_run(ran["cell"]).info.status == "FINISHED"


def test_a_failing_method_run_is_failed_with_its_error_and_the_parent_stays_active(experiment):
    with mlflow.start_run() as parent:
        with pytest.raises(RuntimeError, match="out of memory"):
            with tracking.method_run("spader seed0", {"method": "spader"}, {}) as rid:
                raise RuntimeError("out of memory")
        assert mlflow.active_run().info.run_id == parent.info.run_id
    failed = mlflow.get_run(rid)
    assert failed.info.status == "FAILED" and "out of memory" in failed.data.tags["error"]


def test_a_failing_chain_ends_failed_with_its_failed_method_run(tmp_path):
    """Through the project's hook: the chain run is named for what ran and ends FAILED with the
    error, and so does the method run the error came from."""
    hooks = MlflowTrackingHooks()
    hooks.after_context_created(SimpleNamespace(project_path=tmp_path, env="local", params={}, config_loader={
        "mlflow": {"experiment": f"chain-{tmp_path.name}", "artifact_dir": "artifacts"}}))
    hooks.before_pipeline_run({"pipeline_name": "training"}, training.create_pipeline(), None)
    chain_id = mlflow.active_run().info.run_id
    with pytest.raises(RuntimeError) as error:
        with tracking.method_run("spader seed0", {"method": "spader"}, {}) as rid:
            raise RuntimeError("out of memory")
    hooks.on_pipeline_error(error.value, {}, None, None)
    assert mlflow.active_run() is None
    chain, method = mlflow.get_run(chain_id), mlflow.get_run(rid)
    assert chain.info.run_name.startswith("pipeline training · env local · ")
    assert (chain.info.status, method.info.status) == ("FAILED", "FAILED")
    assert "out of memory" in chain.data.tags["error"] and "out of memory" in method.data.tags["error"]
    assert method.data.tags[tracking.CHAIN_RUN_TAG] == chain_id


def test_without_an_active_run_nothing_is_tracked(experiment, tmp_path):
    with tracking.method_run("grpo seed0", {"method": "grpo"}, {"method": "grpo"}) as rid:
        assert rid is None and mlflow.active_run() is None
        assert tracking.register_checkpoint(tmp_path, name="grpo") is None
        tracking.log_text("text", "compare/report.md")  # no run to write into: nothing happens
        assert tracking.handed_over_run() == (None, None)


def test_another_process_logs_into_the_run_handed_over_and_a_failing_store_only_warns(experiment, monkeypatch, caplog):
    """What a verl worker does: the run named by ``MLFLOW_RUN_ID`` (not the active one) takes its metrics."""
    handed = mlflow.MlflowClient().create_run(experiment).info.run_id
    with mlflow.start_run() as active:
        assert tracking.handed_over_run() == (active.info.run_id, None)  # nothing handed over: the active run
        monkeypatch.setenv("MLFLOW_RUN_ID", handed)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.get_tracking_uri())
        run_id, uri = tracking.handed_over_run()
        assert (run_id, uri) == (handed, mlflow.get_tracking_uri())
        assert tracking.log_metrics_to_run(run_id, {"adv/zero_frac": 0.25}, 3, tracking_uri=uri)
    history = mlflow.MlflowClient().get_metric_history(handed, "adv/zero_frac")
    assert [(m.step, m.value) for m in history] == [(3, 0.25)]
    assert not tracking.log_metrics_to_run("0" * 32, {"adv/zero_frac": 0.5}, 4)  # no such run: warned, not raised
    assert "not logged to MLflow run" in caplog.text


def test_checkpoint_is_an_external_model_of_the_training_run(experiment, tmp_path):
    with mlflow.start_run(), tracking.method_run("spader seed0", {"method": "spader"}, {}) as rid:
        model_id = tracking.register_checkpoint(tmp_path, name="spader", params={"reward": {"alpha": 1.0}})
    model = mlflow.get_logged_model(model_id)
    assert model.source_run_id == rid and model.tags["checkpoint.path"] == str(tmp_path.resolve())
    assert model.params["reward.alpha"] == "1.0"
    manifest = {"method": "spader", "mlflow_run_id": rid, "mlflow_model_id": model_id, "path": str(tmp_path)}
    assert tracking.training_link_tags(manifest) == {"method": "spader", "training_run_id": rid,
                                                     "checkpoint.path": str(tmp_path), "checkpoint.model_id": model_id}


VERL_TRACKER = """
from verl.utils.tracking import Tracking
tracker = Tracking(project_name="spader", experiment_name="train_spader", default_backend=["mlflow"],
                   config={"algorithm": {"adv_estimator": "spa"}})
for step in (1, 2):
    tracker.log({"critic/score/mean": 0.1 * step, "method_reward/mean": 0.2 * step}, step=step)
"""


@pytest.mark.heavy
@pytest.mark.slow
def test_a_verl_training_is_a_method_run_that_verls_own_tracker_writes_into(experiment, tmp_path, monkeypatch, project_root):
    """train_policy with backend verl: the launcher hands the method run's id to the VERL process,
    whose own MLflow tracker (verl.utils.tracking, run here for real) logs into that run. Only the
    GPU training process is replaced: by verl's tracker alone, with the launcher's environment."""
    import subprocess
    import sys

    import pandas as pd

    from spader_pipeline.launch import verl as launch
    from spader_pipeline.pipelines.training.nodes import train_policy

    def fake_verl(argv, env, log_path, **kwargs):
        subprocess.run([sys.executable, "-c", VERL_TRACKER], env=dict(env), check=True, timeout=600)
        (tmp_path / "out/train_spader/checkpoints/global_step_2/actor").mkdir(parents=True)

    monkeypatch.setattr(launch, "run_streaming", fake_verl)
    monkeypatch.chdir(project_root)  # the launcher reads conf/base/verl
    training = {"backend": "verl", "output_dir": str(tmp_path / "out"),
                "verl": {"retrieval": {"url": "http://127.0.0.1:9/"}, "n_gpus_per_node": 1}}
    method = {"method": "spader", "reward": {"alpha": 1.0}, "options": {"gamma": 0.9}}
    prompt = {"template": "t", "templates": {"t": "{question}"}}
    (tmp_path / "init").mkdir()
    (tmp_path / "init/config.json").write_text('{"model_type": "qwen3"}')
    with mlflow.start_run(run_name="train_spader") as parent:
        manifest, history, _ = train_policy({"path": str(tmp_path / "init")}, pd.DataFrame(), {}, method, training, prompt,
                                            verl_validation=pd.DataFrame())
    run = mlflow.get_run(manifest["mlflow_run_id"])
    assert run.data.tags[tracking.CHAIN_RUN_TAG] == parent.info.run_id
    assert (run.info.run_name, run.data.tags["backend"], run.data.tags["method"]) == ("spader seed0", "verl", "spader")
    client = mlflow.MlflowClient()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "method_reward/mean")] == [1, 2]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2]
    assert run.data.params["algorithm/adv_estimator"] == "spa" and run.data.params["options.gamma"] == "0.9"
    assert manifest["backend"] == "verl" and manifest["path"] is None  # merged (and linked) by the merge pipeline
