"""The buffered MLflow writer against a real SQLite store: order, batching, refusals, metric files.
(The outage itself, with a real ``mlflow server`` stopped mid-run: tests/native and tests/launch.)"""

from __future__ import annotations

import json

import mlflow
import pytest

from spader_pipeline.tracking.buffer import BufferedMetricsWriter, mlflow_key
from spader_pipeline.tracking.metrics_files import append_metrics_line, backfill, follow_jsonl


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("buffer", artifact_location=str(tmp_path / "artifacts"))
    return uri, client, client.create_run(experiment).info.run_id


def test_writes_arrive_in_order_in_batches_under_mlflows_limit(store):
    uri, client, run_id = store
    with BufferedMetricsWriter(run_id, uri) as writer:
        for step in range(1, 4):
            writer.log_metrics({**{f"k/{i}": float(i) for i in range(600)}, "loss": 1.0 / step}, step)
        writer.log_metrics({"ok": True, "skipped": "text", "nan": float("nan")}, 4)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert len(client.get_metric_history(run_id, "k/599")) == 3
    assert client.get_metric_history(run_id, "ok")[0].value == 1.0 and "skipped" not in client.get_run(run_id).data.metrics
    assert writer.delivered == 4 and writer.outages == 0


def test_a_write_the_server_refuses_is_dropped_with_a_warning_not_retried(store, caplog):
    uri, client, _ = store
    writer = BufferedMetricsWriter("0" * 32, uri)  # no such run: a definite answer, not an outage
    writer.log_metrics({"loss": 1.0}, 1)
    assert writer.close(timeout=30) is False
    assert writer.dropped == 1 and writer.outages == 0 and "refused" in caplog.text


def test_metric_files_are_followed_to_their_last_complete_line_and_can_be_backfilled(store, tmp_path):
    uri, client, run_id = store
    verl_file, ours = tmp_path / "verl.jsonl", tmp_path / "ours.jsonl"
    with BufferedMetricsWriter(run_id, uri) as writer, follow_jsonl([verl_file, ours], writer, poll_seconds=0.05):
        verl_file.write_text(json.dumps({"step": 1, "data": {"acc/mean@4": 0.5}}) + "\n")
        append_metrics_line(ours, {"adv/zero_frac": 0.25}, 1)
        with verl_file.open("a") as f:
            f.write('{"step": 2, "data": {"acc/mean@4"')  # a line cut by a crash: never sent
    assert [m.step for m in client.get_metric_history(run_id, "acc/mean_at_4")] == [1]
    assert [m.value for m in client.get_metric_history(run_id, "adv/zero_frac")] == [0.25]
    native = tmp_path / "metrics.jsonl"
    native.write_text("".join(json.dumps({"step": s, "answer/recall": s / 10}) + "\n" for s in (1, 2)))
    assert backfill(run_id, native, uri, timeout=30)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "answer/recall")] == [(1, 0.1), (2, 0.2)]
    assert mlflow_key("val-core/q//acc/mean@4 (x)") == "val-core/q/acc/mean_at_4 _x_"
