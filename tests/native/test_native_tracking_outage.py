"""A tracking server that goes down mid-run stops nothing and loses nothing (docs/reliability.md).

``train_native`` logs through :class:`BufferedMetricsWriter` (what the training node does) into a
real ``mlflow server`` process on 127.0.0.1, which is stopped when step 1 is logged and started again,
on the same port, after steps 2 and 3 ran without it.
"""

from __future__ import annotations

import json
import logging

import mlflow
import pytest
from mlflow_server import StoppableServer, short_client_retries
from native_toy import QUESTIONS, TEMPLATE

from spader_pipeline.native import train_native
from spader_pipeline.retrieval import load_retriever
from spader_pipeline.retrieval.service import LocalSearch
from spader_pipeline.tracking.buffer import BufferedMetricsWriter

STEPS, DOWN_AT, UP_AT = 4, 1, 3


@pytest.mark.heavy
@pytest.mark.slow
def test_training_goes_on_while_mlflow_is_down_and_every_step_reaches_the_store(
        tmp_path, native_model_dir, toy_index_dir, tiny_config, caplog):
    with StoppableServer(tmp_path / "mlflow") as server:
        client = mlflow.MlflowClient(server.url)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        writer = BufferedMetricsWriter(run_id, server.url, first_backoff=0.2, max_backoff=1.0)
        logged_while_down = []

        def log_metrics(metrics, step):
            writer.log_metrics(metrics, step)  # returns at once, whatever the server does
            if server.stopped_at is not None:
                logged_while_down.append(step)
            if step == DOWN_AT:
                server.stop()
            elif step == UP_AT:
                server.start()

        with short_client_retries(), caplog.at_level(logging.WARNING, logger="spader_pipeline.tracking.buffer"):
            result = train_native(tiny_config(total_steps=STEPS), model_path=native_model_dir, samples=QUESTIONS,
                                  search=LocalSearch(load_retriever(toy_index_dir)), run_dir=tmp_path / "run",
                                  prompt_template=TEMPLATE, log_metrics=log_metrics,
                                  log_artifact=lambda p: writer.log_artifact(p, "samples"))
            assert writer.close(timeout=120)

        assert result.steps == STEPS and logged_while_down == [2, 3]
        assert writer.outages >= 1 and writer.backlog == 0
        assert any("was down for" in r.getMessage() for r in caplog.records)
        history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        stored = client.get_metric_history(run_id, "answer/recall")
        assert sorted((m.step, m.value) for m in stored) == [(h["step"], h["answer/recall"]) for h in history]
        assert set(client.get_run(run_id).data.metrics) >= {"optim/lr", "loss/total", "perf/step_seconds"}
        assert len(client.list_artifacts(run_id, "samples")) == STEPS
