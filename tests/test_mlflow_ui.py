"""The real MLflow UI server (``mlflow ui`` on 127.0.0.1, what ``make mlflow-ui`` runs) serves a
chain of runs as a user meets it: a model-training experiment whose runs table lists the method
runs (``<method> seed<k>``) and evaluation runs at top level, next to a chain run named for what ran,
comparable through the same REST API the UI's Compare view reads."""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import mlflow
import pytest

from spader_pipeline import tracking
from spader_pipeline.hooks import MlflowTrackingHooks
from spader_pipeline.pipelines import training

#: The request the runs table sends when the experiment page opens (MLflow 3.x): active runs,
#: newest first, no filter.
DEFAULT_RUNS_QUERY = {"filter": "", "run_view_type": "ACTIVE_ONLY", "max_results": 100,
                      "order_by": ["attributes.start_time DESC"]}


def _chain_of_runs(tmp_path, name: str) -> None:
    """What ``kedro run`` logs, through the project's hook: a chain run, one training run per method
    (native trainer keys, comparable ones first), one evaluation run per trained checkpoint."""
    hooks = MlflowTrackingHooks()
    context = SimpleNamespace(project_path=tmp_path, env="local", params={},
                              config_loader={"mlflow": {"experiment": name, "artifact_dir": "artifacts"}})
    hooks.after_context_created(context)
    hooks.before_pipeline_run({"pipeline_name": None}, training.create_pipeline(), None)
    methods = {"grpo": {"reward": {"enable_exploration": False}, "advantage": {"norm_adv_by_std_in_grpo": True}},
               "spader": {"reward": {"enable_exploration": True, "alpha": 1.0}, "advantage": {"gamma": 0.9}}}
    recall = {"grpo": 0.29, "spader": 0.29}
    for method, block in methods.items():
        with tracking.method_run(f"{method} seed0", {"method": method, "backend": "native", "seed": 0},
                                 {"method": method, **block}) as run_id:
            for step in (1, 2):
                own_return = (0.3 if method == "grpo" else 0.6) * step  # SPADER's adds a discovery term
                tracking.log_metrics({"method_reward/mean": own_return, "answer/recall": 0.2 * step,
                                      "retrieval/recall": 0.4}, step=step)
        with tracking.linked_run(f"evaluate:{method}:embedded_test", {"model": method, "training_run_id": run_id}):
            tracking.log_metrics({"recall": recall[method], "f1": 0.3})
            tracking.log_heldout(run_id, "embedded_test", {"recall": recall[method], "f1": 0.3})
    hooks.after_pipeline_run({}, None, None)


@pytest.mark.slow
def test_the_runs_table_lists_method_and_evaluation_runs_at_first_sight(tmp_path):
    name = f"ui-{tmp_path.name}"
    _chain_of_runs(tmp_path, name)
    experiment_id = mlflow.get_experiment_by_name(name).experiment_id

    with tracking.running_ui(os.environ["MLFLOW_TRACKING_URI"], tmp_path / "artifacts") as url:
        client = httpx.Client(base_url=url, timeout=30.0, trust_env=False)
        assert "<html" in client.get("/").text.lower()  # the UI itself
        experiment = client.get("/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name}).json()
        tags = {t["key"]: t["value"] for t in experiment["experiment"]["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"  # opens on the runs table
        answer = client.post("/api/2.0/mlflow/runs/search", json={"experiment_ids": [experiment_id], **DEFAULT_RUNS_QUERY})
        assert answer.status_code == 200, answer.text
        listed = answer.json()["runs"]
        tagged = [({t["key"]: t["value"] for t in r["data"].get("tags", [])}, r) for r in listed]
        # rows the table shows without expanding anything: runs without a parent
        top_level = {r["info"]["run_name"]: (t, r) for t, r in tagged if "mlflow.parentRunId" not in t}
        chain = [n for n, (t, _) in top_level.items() if "kedro.pipeline" in t]
        assert len(chain) == 1 and chain[0].startswith("full chain · env local · ")  # not `__default__`
        chain_id = top_level[chain[0]][1]["info"]["run_id"]
        assert set(top_level) == {chain[0], "grpo seed0", "spader seed0",
                                  "evaluate:grpo:embedded_test", "evaluate:spader:embedded_test"}
        for run_name, (run_tags, _) in top_level.items():
            if run_name != chain[0]:
                assert (run_tags["chain_run_id"], run_tags["chain"]) == (chain_id, chain[0])
        runs = {top_level[f"{m} seed0"][0]["method"]: top_level[f"{m} seed0"][1] for m in ("grpo", "spader")}
        params = {m: {p["key"]: p["value"] for p in r["data"]["params"]} for m, r in runs.items()}
        assert params["grpo"]["reward.enable_exploration"] != params["spader"]["reward.enable_exploration"]
        for run in runs.values():
            metrics = [m["key"] for m in run["data"]["metrics"]]
            # Compare's parallel-coordinates plot shows the first listed metric: a comparable one
            assert metrics[0] == "answer/recall" and "method_reward/mean" in metrics
            values = {m["key"]: m["value"] for m in run["data"]["metrics"]}
            assert values["heldout/embedded_test/recall"] == 0.29  # held-out recall on the training run
            history = client.get("/api/2.0/mlflow/metrics/get-history", params={
                "run_id": run["info"]["run_id"], "metric_key": "answer/recall"}).json()["metrics"]
            assert [m["step"] for m in history] == [1, 2]  # same key in both runs: the charts overlay them
