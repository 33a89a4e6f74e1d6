"""verl's metrics under a tracking outage (docs/reliability.md): the launcher's configuration sends
verl's real ``Tracking`` (its ``file`` tracker) and our plugin's step metrics to local files, which the
launcher ships through :class:`BufferedMetricsWriter`; a real ``mlflow server`` on 127.0.0.1 is stopped
during step 1 and started again at step 3. No step waits, and every step reaches the store."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from kedro.config import OmegaConfigLoader
from mlflow_server import StoppableServer, short_client_retries

from spader_pipeline.launch.command import build_launch
from spader_pipeline.tracking.buffer import BufferedMetricsWriter
from spader_pipeline.tracking.metrics_files import METRICS_PATH_ENV, follow_jsonl
from spader_pipeline.training import TrainingSettings

pytest.importorskip("verl")
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.mark.slow
def test_verl_metrics_reach_the_store_across_a_tracking_outage(tmp_path, monkeypatch, caplog):
    from verl.utils.tracking import Tracking

    from spader_pipeline.verl_plugin.batch_reward import log_step_metrics

    monkeypatch.chdir(ROOT)  # config paths in parameters are project-relative
    params = OmegaConfigLoader(str(ROOT / "conf"), base_env="base", default_run_env="base")["parameters"]
    frame = pd.DataFrame({"data_source": ["embedded"]})  # the node's verl_train / verl_validation
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with StoppableServer(tmp_path / "mlflow") as server:
        client = mlflow.MlflowClient(server.url)
        run_id = client.create_run(client.create_experiment("verl-outage")).info.run_id
        settings = TrainingSettings.from_mapping({**params["training"], "backend": "verl"},
                                                 params["train_spader"]["method"])
        launch = build_launch({"path": str(tmp_path / "warm")}, settings.verl_launch(), tmp_path / "run", retrieval_url="http://127.0.0.1:8123", tracking_uri=server.url,
                              run_id=run_id, train=frame, validation=frame)
        assert "mlflow" not in launch.extra["params"]["logger"]
        for key in ("VERL_FILE_LOGGER_PATH", METRICS_PATH_ENV, "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
            monkeypatch.setenv(key, launch.env[key])  # verl's process, here in this one
        writer = BufferedMetricsWriter(run_id, server.url, first_backoff=0.2, max_backoff=1.0)
        with short_client_retries(), caplog.at_level(logging.WARNING, logger="spader_pipeline.tracking.buffer"):
            with follow_jsonl(launch.extra["metrics_files"], writer, poll_seconds=0.1):
                tracker = Tracking("spader", "train_spader", default_backend=launch.extra["params"]["logger"])
                for step in range(1, STEPS + 1):
                    tracker.log({"critic/score/mean": step / 10, "val-core/q/acc/mean@4": 0.5}, step)
                    log_step_metrics({"adv/zero_frac": step / 8}, step)
                    if step == 1:
                        server.stop()
                    elif step == 3:
                        server.start()
                tracker.finish()
            assert writer.close(timeout=120)
        history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
                   for key in ("critic/score/mean", "adv/zero_frac", "val-core/q/acc/mean_at_4")}
    assert history["critic/score/mean"] == [(s, s / 10) for s in range(1, STEPS + 1)]
    assert history["adv/zero_frac"] == [(s, s / 8) for s in range(1, STEPS + 1)]
    assert [s for s, _ in history["val-core/q/acc/mean_at_4"]] == list(range(1, STEPS + 1))
    assert writer.outages >= 1 and any("was down for" in r.getMessage() for r in caplog.records)
