"""The real MLflow UI server (``mlflow ui`` on 127.0.0.1, what ``make mlflow-ui`` runs) serves the
project's runs: a model-training experiment with one run per method, comparable through the same
REST API the UI's Compare view reads."""

from __future__ import annotations

import os

import httpx
import mlflow
import pytest

from spader_pipeline import tracking


@pytest.mark.slow
def test_mlflow_ui_serves_one_run_per_method_with_shared_metric_keys(tmp_path):
    name = f"ui-{tmp_path.name}"
    experiment_id = tracking.ensure_experiment(name, tmp_path / "artifacts")
    mlflow.set_experiment(experiment_id=experiment_id)
    methods = {"grpo": {"reward": {"enable_exploration": False}, "advantage": {"norm_adv_by_std_in_grpo": True}},
               "spader": {"reward": {"enable_exploration": True, "alpha": 1.0}, "advantage": {"gamma": 0.9}}}
    with mlflow.start_run(run_name="__default__"):
        for method, block in methods.items():
            with tracking.method_run(f"{method} seed0", {"method": method, "backend": "native", "seed": 0},
                                     {"method": method, **block}):
                for step in (1, 2):
                    tracking.log_metrics({"method_reward/mean": 0.1 * step, "answer/recall": 0.2 * step}, step=step)

    with tracking.running_ui(os.environ["MLFLOW_TRACKING_URI"], tmp_path / "artifacts") as url:
        client = httpx.Client(base_url=url, timeout=30.0, trust_env=False)
        assert "<html" in client.get("/").text.lower()  # the UI itself
        experiment = client.get("/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name}).json()
        tags = {t["key"]: t["value"] for t in experiment["experiment"]["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"  # opens on the runs table
        answer = client.post("/api/2.0/mlflow/runs/search", json={"experiment_ids": [experiment_id]})
        assert answer.status_code == 200, answer.text
        tagged = [({t["key"]: t["value"] for t in r["data"]["tags"]}, r) for r in answer.json()["runs"]]
        runs = {tags["method"]: r for tags, r in tagged if "method" in tags}
        assert set(runs) == {"grpo", "spader"}
        params = {m: {p["key"]: p["value"] for p in r["data"]["params"]} for m, r in runs.items()}
        assert params["grpo"]["reward.enable_exploration"] != params["spader"]["reward.enable_exploration"]
        for run in runs.values():
            history = client.get("/api/2.0/mlflow/metrics/get-history", params={
                "run_id": run["info"]["run_id"], "metric_key": "answer/recall"}).json()["metrics"]
            assert [m["step"] for m in history] == [1, 2]  # same key in both runs: the charts overlay them
