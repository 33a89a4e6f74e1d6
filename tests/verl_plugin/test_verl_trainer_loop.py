"""verl 0.9.1's own trainer loop on CPU, for every method: ``RayPPOTrainer.fit()``, 2 steps + validation.

Real: Hydra composition of ``conf/base/verl/method.yaml`` (the method's settings from the registry) with the overrides the launcher generates
(:func:`spader_pipeline.launch.verl.verl_parameters` → ``build_overrides``), verl's ``main()`` checks
(``validate_config``) and its legacy ``TaskRunner.run`` (datasets, ``RLHFDataset`` over parquet written
by our ``data_prep`` format, dataloaders, ``RayPPOTrainer``), ``AgentLoopWorker`` running the
``spader_search`` loop and ``SearchTool`` against our retrieval service on 127.0.0.1,
``RewardLoopWorker`` with the ``spader`` reward manager, ``GroupRewardAgentLoopManager`` (loaded by
verl from ``agent_loop_manager_class``), verl's LLM server manager / load balancer / client,
``compute_advantage`` with our estimators, verl's metrics and file tracker. Every Ray worker gets
the plugin the way a launch's workers do: ``VERL_USE_EXTERNAL_MODULES`` as the launcher sets it
(:func:`spader_pipeline.launch.verl.verl_environment`), with verl's entry-point discovery off.

Replaced (see :mod:`verl_cpu_boundary`): the LLM server engine, the FSDP actor/ref worker group and
the checkpoint (weight-sync) manager. One Ray session serves the four methods and a fifth defined
outside the project (``tests/algorithms/toy_method.py``, which its workers import as a user's method
module would be imported).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "algorithms"))

from reference_loops import loop_spa  # noqa: E402
from toy_method import TOY, WORKER_FLAG, ToyOptions  # noqa: E402
from verl_cpu_boundary import (  # noqa: E402
    SERVER_NAME,
    CpuResourcePoolManager,
    RecordingWorkerGroup,
    ScriptedReplica,
    start_scripted_server,
)
from verl_loop_support import (  # noqa: E402
    BOUNDARY_OVERRIDES,
    MAX_MODEL_LEN,
    PROMPT_LENGTH,
    RESPONSE_LENGTH,
    compose_config,
    local_ray,
    method_block,
    run_fit,
)

# verl's whole fit() loop, in Ray actors, five times: make test-verl's tier (CI runs it after make test
# where its time limit allows, .ci/run), beside verl's real workers
pytestmark = [pytest.mark.verl_workers, pytest.mark.slow, pytest.mark.e2e]

METHODS = ("grpo", "spader", "calibadv", "tspo")
TOOL_COST = 0.2  # scaled up (the configs use 0.01) so it is visible; only where the method pays one
FREE_STEPS = 2  # the schedule: step 1 is free, step 2 pays the full cost (no ramp)


@pytest.fixture(scope="module")
def ray_session(workspace):
    """One local Ray for the four methods and the toy: the runs prove that what the launch forwards
    registers everything in verl's workers, and that a user's method module (``VERL_USE_EXTERNAL_MODULES``)
    reaches them the same way."""
    with local_ray(paths=[HERE.parent / "algorithms"], modules=["toy_method"], env={WORKER_FLAG: "1"}):
        yield start_scripted_server(str(workspace["model"]), PROMPT_LENGTH, RESPONSE_LENGTH, MAX_MODEL_LEN)


def pays_tool_cost(method: str) -> bool:
    return bool(method_block(method)["reward"].get("tool_round_cost"))


def _compose(method: str, ws: dict, run_dir: Path, *, config_dir: Path = ROOT / "conf/base/verl",
             block: dict | None = None):
    """The method's config with the stand-ins' overrides; SPADER's group terms run with 2 agent-loop
    workers (verl pads the 3 validation prompts to 4)."""
    workers = 2 if method == "spader" else 1
    return compose_config(block or method_block(method, TOOL_COST), ws, run_dir, config_dir=config_dir,
                          reward={"cost_free_steps": FREE_STEPS, "cost_rampup_steps": 0},
                          overrides=[*BOUNDARY_OVERRIDES, f"actor_rollout_ref.rollout.agent.num_workers={workers}"])


def run_trainer_loop(method: str, ws: dict, run_dir: Path, **compose) -> tuple[list[dict], object]:
    """verl's ``main()`` checks and its legacy ``TaskRunner.run`` with the GPU boundaries replaced; returns
    the metrics verl's file tracker logged and the composed config (``compose``: see :func:`_compose`)."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner, TaskRunner
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    config = _compose(method, ws, run_dir, **compose)

    class CpuTaskRunner(BaseTaskRunner):
        run = TaskRunner.__ray_metadata__.modified_class.run  # verl's own, unchanged

        def add_actor_rollout_worker(self, config):
            # verl's role mapping; only the worker group that would start FSDP workers is swapped
            actor_rollout_cls, _ = super().add_actor_rollout_worker(config)
            return actor_rollout_cls, RecordingWorkerGroup

        def init_resource_pool_mgr(self, config):
            spec = {"global_pool": [config.trainer.n_gpus_per_node] * config.trainer.nnodes}
            return CpuResourcePoolManager(resource_pool_spec=spec, mapping=self.mapping)

    RolloutReplicaRegistry.register("sglang", lambda: ScriptedReplica)
    RecordingWorkerGroup.calls = []
    return run_fit(config, run_dir, task_runner=CpuTaskRunner, keep_actors=[SERVER_NAME]), config


@pytest.fixture(scope="module")
def runs(workspace, ray_session, tmp_path_factory):
    """Each method's trainer loop, with an MLflow run handed over as the launcher does (``MLFLOW_RUN_ID``)."""
    import mlflow

    store = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("trainer-loop", artifact_location=str(store / "artifacts"))
    out = {}
    for method in METHODS:
        run_dir = tmp_path_factory.mktemp(f"run-{method}")
        run_id = client.create_run(experiment, run_name=f"{method} seed0").info.run_id
        saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
        os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_RUN_ID=run_id)
        start = time.perf_counter()
        try:
            metrics, config = run_trainer_loop(method, workspace, run_dir)
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        print(f"{method}: trainer loop {time.perf_counter() - start:.1f} s", file=sys.stderr)
        logged = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
                  for key in client.get_run(run_id).data.metrics}
        out[method] = {"metrics": metrics, "calls": list(RecordingWorkerGroup.calls), "config": config,
                       "mlflow": logged}
    return out


def _updates(run) -> list:
    return [td for name, td in run["calls"] if name == "update_actor"]


def _non_tensor(td, key: str) -> np.ndarray:
    """A per-row non-tensor field of a recorded TensorDict as verl's 1-d object array."""
    from verl.utils import tensordict_utils as tu

    values = tu.get(td, key)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _row_fields(td) -> dict[str, np.ndarray]:
    """Every per-row non-tensor field (``uid``, reward extras, agent-loop fields) of a recorded batch."""
    from verl.utils import tensordict_utils as tu

    rows = td["advantages"].shape[0]
    keys = [k for k in td.keys() if not isinstance(td.get(k), torch.Tensor)]
    return {k: _non_tensor(td, k) for k in keys if isinstance(tu.get(td, k), list) and len(tu.get(td, k)) == rows}


@pytest.mark.parametrize("method", METHODS)
def test_trainer_loop_trains_two_steps_and_validates(runs, method):
    run = runs[method]
    assert [m["step"] for m in run["metrics"]] == [0, 1, 2]  # validation before training, then 2 steps
    before, *train = (m["data"] for m in run["metrics"])
    assert "val-core/embedded/reward/mean@1" in before, sorted(before)
    assert "val-aux/embedded/f1/mean@1" in before
    assert "val-core/embedded/reward/mean@1" in train[-1]  # the last step validates too
    for data in train:
        assert {"critic/advantages/mean", "critic/score/mean", "timing_s/gen", "num_turns/mean"} <= set(data)
        # the retrieval service answered every search (the error rate reaches verl's metrics)
        assert data["timing_s/search/calls"] > 0 and data["timing_s/search/error_rate"] == 0.0
        assert data["tool_call_counts/max"] >= 1
    names = [name for name, _ in run["calls"]]
    assert names.count("update_actor") == 2 and names.count("compute_log_prob") == 2
    assert names.count("compute_ref_log_prob") == 2  # KL loss: the reference policy is used


@pytest.mark.parametrize("method", METHODS)
def test_each_training_step_logs_whether_the_update_differs_from_grpo(runs, method):
    """group/* and adv/*_vs_grpo (docs/metrics.md) reach the run's MLflow run for both training steps,
    under the native trainer's names; validation batches are not logged as steps."""
    logged = runs[method]["mlflow"]
    for key in ("adv/corr_vs_grpo", "adv/rel_l2_vs_grpo", "adv/zero_frac", "adv/grpo_zero_frac",
                "group/distinct_query_seqs", "group/diverse_frac",
                "group/distinct_docs", "group/entity_recall_union", "group/entity_recall_mean",
                "group/first_divergence_turn", "group/identical_frac",
                # the native trainer's rollout metrics (algorithms.step_metrics), under its names
                "method_reward/mean", "method_reward/tool_cost_coef", "answer/recall", "answer/format_ok",
                "retrieval/recall", "rollout/turns", "rollout/tool_calls", "rollout/response_tokens",
                "adv/mean", "adv/abs_mean", "adv/zero_groups"):
        assert [step for step, _ in logged[key]] == [1, 2], (key, logged.get(key))
    assert all(n >= 1 for _, n in logged["group/distinct_query_seqs"])
    # validation curves under the native trainer's names, before training and at test_freq (step 2)
    for key in ("val/embedded/recall", "val/embedded/f1", "val/embedded/searches"):
        assert [step for step, _ in logged[key]] == [0, 2], (key, logged.get(key))
        assert all(0.0 <= v for _, v in logged[key])
    # the scripted plans of a group of 4 search 1, 1, 2 and 0 times (the response budget may cut one)
    assert all(0.5 <= v <= 1.0 for _, v in logged["rollout/tool_calls"]), logged["rollout/tool_calls"]
    if method == "grpo":  # GRPO against itself: identical, or undefined when every group ties
        assert all(math.isnan(c) or c == pytest.approx(1.0) for _, c in logged["adv/corr_vs_grpo"])
        assert logged["adv/zero_frac"] == logged["adv/grpo_zero_frac"]


@pytest.mark.parametrize("method", METHODS)
def test_actor_gets_advantages_only_on_model_tokens(runs, method):
    for td in _updates(runs[method]):
        adv, mask = td["advantages"], td["response_mask"]
        assert adv.shape == mask.shape and adv.shape[0] == 8  # 2 prompts x 4 rollouts
        assert torch.all(adv[mask == 0] == 0), "advantage on an observation or padding token"
        assert torch.any(adv != 0), "no learning signal"
        observed = (mask == 0) & (td["responses"] != 0)  # observation tokens inside the response
        assert observed.any()


def test_spa_step_advantages_match_an_independent_computation(runs):
    gamma = float(runs["spader"]["config"].algorithm.spa.gamma)
    for td in _updates(runs["spader"]):
        expected, _ = loop_spa(td["token_level_rewards"], td["response_mask"], list(_non_tensor(td, "uid")),
                               gamma=gamma)
        torch.testing.assert_close(td["advantages"], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_global_step_reaches_the_reward(runs, method):
    """Step 1 is inside the free steps, step 2 pays the tool cost: the actor's rewards must show it
    (re-assembled through verl's reward-manager interface at a chosen step)."""
    from verl import DataProto
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    run = runs[method]
    reward_cls = resolve_reward_manager_cls(run["config"])
    reward_cls.configure(run["config"])
    charged = []
    for step, td in enumerate(_updates(run), start=1):
        non_tensor = _row_fields(td)

        def assembled(global_step, td=td, non_tensor=non_tensor):
            data = DataProto.from_dict(tensors={"response_mask": td["response_mask"]}, non_tensors=non_tensor,
                                       meta_info={"global_steps": global_step})
            return reward_cls.assemble_rm_scores(data, [0.0] * len(data))

        torch.testing.assert_close(td["token_level_scores"], assembled(step))
        charged.append(not torch.allclose(assembled(step), assembled(0)))
    assert charged == [False, pays_tool_cost(method)]



def test_a_method_defined_outside_the_project_trains_through_fit(ray_session, workspace, tmp_path):
    """Adding a method is one definition: the toy (registered here and, through the module verl's
    workers import, there) trains in verl's ``fit()`` with its settings from the registry, no overlay
    file; the actor gets exactly the toy's advantages. Same Ray session as the four methods."""
    import spader_pipeline.verl_plugin  # noqa: F401  (registers the estimators: the toy's too)
    from spader_pipeline.algorithms.methods import method_advantages, registered

    block = {"method": "toy", "reward": {"tool_round_cost": 0.0}, "options": {"scale": 2.0}}
    with registered(TOY):
        metrics, config = run_trainer_loop("toy", workspace, tmp_path / "run", block=block)
        calls = list(RecordingWorkerGroup.calls)
        assert config.algorithm.adv_estimator == "toy_baseline" and config.algorithm.toy_baseline.scale == 2.0
        assert [m["step"] for m in metrics] == [0, 1, 2]
        updates = [td for name, td in calls if name == "update_actor"]
        assert len(updates) == 2
        for td in updates:
            rewards, mask = td["token_level_rewards"], td["response_mask"]
            assert ((rewards != 0).sum(dim=1) <= 1).all()  # the outcome only, on the answer step
            expected, _ = method_advantages("toy", rewards, mask, list(_non_tensor(td, "uid")), ToyOptions(scale=2.0))
            torch.testing.assert_close(td["advantages"], expected)
            assert torch.any(td["advantages"] != 0)
