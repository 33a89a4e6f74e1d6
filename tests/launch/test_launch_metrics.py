"""A verl run's metrics under the native trainer's names: in its MLflow run (the follower adds them to
verl's own) and in the history the report draws (read back from the launch's files)."""

from __future__ import annotations

import mlflow
import pytest

from spader_pipeline.launch.metrics import (
    METRICS_FILES,
    NATIVE_NAMES,
    earlier_launches_part,
    following,
    training_history,
    with_native_names,
)
from spader_pipeline.tracking.metrics_files import append_metrics_line

VERL_STEP = {"actor/pg_loss": 0.25, "actor/entropy": 1.5, "timing_s/step": 30.0, "critic/score/mean": 0.2}
PLUGIN_STEP = {"answer/recall": 0.4, "adv/corr_vs_grpo": 0.9, "val/embedded/recall": 0.3}


def test_verl_names_gain_their_native_names():
    named = with_native_names(VERL_STEP)
    assert named["loss/policy"] == 0.25 and named["policy/entropy"] == 1.5 and named["perf/step_seconds"] == 30.0
    assert named["actor/pg_loss"] == 0.25  # verl's own names stay
    assert set(NATIVE_NAMES.values()).isdisjoint(NATIVE_NAMES)
    # without recomputed old log-probs (bypass_mode) verl logs the entropy as its update's entropy term
    assert with_native_names({"actor/entropy_loss": 1.25})["policy/entropy"] == 1.25
    assert with_native_names({"actor/entropy_loss": 1.25, "actor/entropy": 1.5})["policy/entropy"] == 1.5


def test_the_history_merges_both_files_by_step_under_native_names(tmp_path):
    verl, plugin = (tmp_path / name for name in METRICS_FILES)
    append_metrics_line(plugin, {"val/embedded/recall": 0.1}, 0)
    for step in (1, 2):
        append_metrics_line(verl, {**VERL_STEP, "training/global_step": step, "note": "text",
                                   "val-core/embedded/reward/mean@1": 0.5}, step)
        append_metrics_line(plugin, PLUGIN_STEP, step)
    history = training_history(tmp_path)
    assert [row["step"] for row in history] == [0, 1, 2]
    assert history[0] == {"step": 0, "val/embedded/recall": 0.1}
    assert history[2]["loss/policy"] == 0.25 and history[2]["answer/recall"] == 0.4
    assert "note" not in history[1]  # numbers only, under the keys MLflow takes
    assert history[1]["val-core/embedded/reward/mean_at_1"] == 0.5
    assert training_history(tmp_path / "nothing") == []


def test_a_resumed_runs_history_spans_its_launches(tmp_path):
    # launch 1: validated at step 0, trained steps 1-3, checkpointed at step 2, killed during step 4's validation
    verl, plugin = (tmp_path / name for name in METRICS_FILES)
    append_metrics_line(plugin, {"val/fitted/f1": 0.4}, 0)
    for step in (1, 2, 3):
        append_metrics_line(verl, {"actor/pg_loss": float(step)}, step)
        append_metrics_line(plugin, {"answer/f1": 0.5}, step)
    with following([verl, plugin]):  # launch 2 keeps launch 1's files aside (no MLflow run: nothing sent)
        # it resumes from step 2's checkpoint: validates it, then redoes step 3
        append_metrics_line(plugin, {"val/fitted/f1": 0.6}, 2)
        append_metrics_line(verl, {"actor/pg_loss": 30.0}, 3)
    assert len(list(tmp_path.glob("*.jsonl"))) == 4  # two launches, kept aside under one time
    history = training_history(tmp_path)
    assert [row["step"] for row in history] == [0, 1, 2, 3]
    assert history[0]["val/fitted/f1"] == 0.4  # the first launch's validation of the start
    assert history[2] == {"step": 2, "loss/policy": 2.0, "actor/pg_loss": 2.0, "answer/f1": 0.5, "val/fitted/f1": 0.6}
    assert history[3] == {"step": 3, "loss/policy": 30.0, "actor/pg_loss": 30.0}  # the redone step, not the killed one's
    # what the second launch's MLflow run is sent at its end: the first launch's part of that history
    assert earlier_launches_part(tmp_path) == {0: {"val/fitted/f1": 0.4},
                                               1: {"loss/policy": 1.0, "actor/pg_loss": 1.0, "answer/f1": 0.5},
                                               2: {"loss/policy": 2.0, "actor/pg_loss": 2.0, "answer/f1": 0.5}}


@pytest.mark.slow
def test_the_follower_logs_the_native_names_into_the_run(tmp_path):
    # The tracking URI and the active experiment are process state: a Kedro run earlier in this worker
    # may have set both (the hooks do), so the test names its own store and experiment, and puts the
    # previous store back.
    uri, previous = f"sqlite:///{tmp_path / 'mlflow.db'}", mlflow.get_tracking_uri()
    files = [tmp_path / name for name in METRICS_FILES]
    experiment = mlflow.MlflowClient(uri).create_experiment("follower")
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(experiment_id=experiment) as run:
            with following(files):
                append_metrics_line(files[0], VERL_STEP, 1)
    finally:
        mlflow.set_tracking_uri(previous)
    logged = mlflow.MlflowClient(uri).get_run(run.info.run_id).data.metrics
    assert logged["loss/policy"] == 0.25 and logged["actor/pg_loss"] == 0.25 and logged["perf/step_seconds"] == 30.0


@pytest.mark.slow
def test_a_resumed_launchs_run_holds_the_whole_history(tmp_path):
    uri, previous = f"sqlite:///{tmp_path / 'mlflow.db'}", mlflow.get_tracking_uri()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    files = [run_dir / name for name in METRICS_FILES]
    append_metrics_line(files[1], {"val/fitted/f1": 0.4}, 0)  # the killed launch: step 0's validation, step 1
    append_metrics_line(files[0], {"actor/pg_loss": 1.0}, 1)
    experiment = mlflow.MlflowClient(uri).create_experiment("resumed")
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(experiment_id=experiment) as run, following(files):
            append_metrics_line(files[1], {"val/fitted/f1": 0.6}, 1)  # resumed from step 1's checkpoint
    finally:
        mlflow.set_tracking_uri(previous)
    client = mlflow.MlflowClient(uri)
    fitted = client.get_metric_history(run.info.run_id, "val/fitted/f1")
    assert sorted((m.step, m.value) for m in fitted) == [(0, 0.4), (1, 0.6)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss/policy")] == [(1, 1.0)]
