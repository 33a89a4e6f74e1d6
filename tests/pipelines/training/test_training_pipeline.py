"""A real ``kedro run`` of data prep → index → base model → training (warm start, GRPO, SPADER)
through KedroSession on a small slice of the embedded default, tracked in a tmp MLflow store."""

from __future__ import annotations

import json

import mlflow
import pytest
from kedro.framework.session import KedroSession
from transformers import AutoModelForCausalLM, AutoTokenizer

from spader_pipeline.pipelines import training


def test_method_pipelines_differ_only_in_their_namespaced_method_block():
    grpo, spader = training.method_pipeline("grpo"), training.method_pipeline("spader")
    assert [n.name for n in grpo.nodes] == ["train_grpo.train_policy"]
    assert grpo.inputs() == {"warm_start_manifest", "warm_start_validation", "verl_train", "verl_validation", "index_manifest", "params:train_grpo.method",
                             "params:training", "params:prompt"}
    assert {i.replace("spader", "grpo") for i in spader.inputs()} == grpo.inputs()
    assert training.create_pipeline().outputs() >= {"train_grpo.policy_manifest", "train_spader.policy_manifest"}


@pytest.mark.heavy
@pytest.mark.e2e
@pytest.mark.slow
def test_training_session_run_two_native_steps_per_method(kedro_project, monkeypatch, node_starts):
    from spader_pipeline import child_process

    seen = node_starts.names
    start_server = child_process.start_server
    monkeypatch.setattr(child_process, "start_server", lambda: seen.append("start_server") or start_server())
    runtime = {"data_prep": {"wiki": {"limit": 400}}}
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=runtime) as session:
        session._hook_manager.register(node_starts)
        session.run(pipeline_names=["data_prep", "index_build", "base_model", "training"])
    # the fork server of the stages' children starts with the run (ForkServerHooks), before its first node
    assert seen[0] == "start_server" and seen.count("start_server") == 1 and len(seen) > 5

    for method in ("grpo", "spader"):
        manifest = json.loads((kedro_project / f"data/06_models/train_{method}/policy_manifest.json").read_text())
        assert manifest["steps"] == 2 and manifest["method"] == method
        model = AutoModelForCausalLM.from_pretrained(manifest["path"])
        assert model.config.model_type == "qwen3"
        AutoTokenizer.from_pretrained(manifest["path"])
        ckpt = kedro_project / f"data/06_models/train_{method}/checkpoints/step_000002"
        AutoModelForCausalLM.from_pretrained(ckpt)
        history = json.loads((kedro_project / f"data/07_model_output/train_{method}/training_history.json").read_text())
        # step 0: the warm start's validation (conf/test: every 2 steps), then the two RL steps
        assert [h["step"] for h in history] == [0, 1, 2]
        assert set(history[0]) == {"step", "val/embedded/recall", "val/embedded/f1", "val/embedded/searches"}
        assert "val/embedded/recall" in history[2] and "val/embedded/recall" not in history[1]

    # MLflow: one top-level run per method's training, linked to the kedro run by tags, with the same
    # metric keys for every method and the method block as parameters that differ between them.
    experiment = mlflow.get_experiment_by_name("spader-pipeline-test")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = mlflow.search_runs(experiment_ids=[experiment.experiment_id], output_format="list",
                              order_by=["start_time DESC"])
    parent = next(r for r in runs if r.data.tags.get("kedro.pipeline") == "data_prep,index_build,base_model,training")
    assert parent.info.status == "FINISHED"
    children = {r.data.tags["method"]: r for r in runs
                if r.data.tags.get("chain_run_id") == parent.info.run_id and "method" in r.data.tags}
    assert set(children) == {"grpo", "spader"}
    client = mlflow.MlflowClient()
    for method, run in children.items():
        assert run.info.run_name == f"{method} seed0" and run.info.status == "FINISHED"
        assert "mlflow.parentRunId" not in run.data.tags and run.data.tags["chain"] == parent.info.run_name
        assert (run.data.tags["backend"], run.data.tags["seed"], run.data.tags["base_model"]) == ("native", "0", "base_model")
        for key in ("method_reward/mean", "answer/recall", "answer/f1", "retrieval/recall", "method_reward/discovery_mean",
                    "adv/std", "loss/kl", "perf/step_seconds"):
            steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
            assert steps == [1, 2], (method, key)
        val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/embedded/recall")]
        assert val_steps == [0, 2], (method, val_steps)
        assert run.data.metrics["steps"] == 2
        manifest = json.loads((kedro_project / f"data/06_models/train_{method}/policy_manifest.json").read_text())
        assert manifest["mlflow_run_id"] == run.info.run_id
        assert mlflow.get_logged_model(manifest["mlflow_model_id"]).source_run_id == run.info.run_id
    grpo, spader = children["grpo"].data.params, children["spader"].data.params
    differing = {k for k in grpo.keys() | spader.keys() if grpo.get(k) != spader.get(k)}
    assert {"method", "reward.tool_round_cost", "reward.alpha", "options.gamma"} <= differing
    assert grpo["reward.cost_free_steps"] == spader["reward.cost_free_steps"]  # shared settings: equal
    assert not any(k.startswith("train_") for k in parent.data.metrics)  # no method-prefixed metric names
    assert "warm_start/demonstrations" in parent.data.metrics
    # the warm start ran in a child process: its loss curve reached the chain run by id
    assert client.get_metric_history(parent.info.run_id, "warm_start/train/loss")
    samples = client.list_artifacts(children["spader"].info.run_id, "samples")
    assert [a.path.rsplit("/", 1)[-1] for a in samples] == ["step_000001.json", "step_000002.json"]
