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

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
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

# verl's whole fit() loop, in Ray actors, five times in one worker: the suite's longest module
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.longest]

METHODS = ("grpo", "spader", "calibadv", "tspo")
TOOL_COST = 0.2  # scaled up (the configs use 0.01) so it is visible; only where the method pays one
FREE_STEPS = 2  # the schedule: step 1 is free, step 2 pays the full cost (no ramp)
PROMPT_LENGTH, RESPONSE_LENGTH, MAX_MODEL_LEN = 512, 256, 768

DOCS = [
    ("Ghana", "Country in West Africa. Accra is the capital of Ghana."),
    ("Togo", "Country in West Africa. Lome is the capital of Togo."),
    ("Benin", "Country in West Africa. Porto-Novo is the capital of Benin."),
    ("Senegal", "Country in West Africa. Dakar is the capital of Senegal."),
    ("Kenya", "Country in East Africa. Nairobi is the capital of Kenya."),
    ("Hamlet", "Play by William Shakespeare. A prince of Denmark seeks revenge."),
]
QUESTIONS = [
    ("train", "t0", "Which countries are in West Africa?", [["Ghana"], ["Togo"], ["Benin"], ["Senegal"]]),
    ("train", "t1", "Which country has Nairobi as its capital?", [["Kenya"]]),
    ("train", "t2", "Which plays did William Shakespeare write?", [["Hamlet"]]),
    ("train", "t3", "Which West Africa country has Dakar as capital?", [["Senegal"]]),
    ("validation", "v0", "Which countries in West Africa have a capital?", [["Ghana"], ["Togo"], ["Benin"]]),
    ("validation", "v1", "Which play is about a prince of Denmark?", [["Hamlet"]]),
    ("validation", "v2", "Which country in East Africa is there?", [["Kenya"]]),
]


def _template() -> str:
    import yaml

    prompt = yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"]
    from spader_pipeline.agent.prompts import resolve_template

    return resolve_template(prompt)


@contextmanager
def trainer_loop_workspace(root: Path):
    """Tiny Qwen3 + tokenizer, a 6-document BM25 index served on 127.0.0.1, VERL parquet files."""
    from spader_pipeline.data.formats import verl_rows
    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model
    from spader_pipeline.retrieval import build_index_from_file, running_service

    template = _template()
    texts = [f"{t}\n{c}" for t, c in DOCS] + [template] + [q for *_, q, _ in QUESTIONS]
    texts += ['<think>I should search.</think><tool_call>["x"]</tool_call><answer>["Ghana"]</answer>'] * 3
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=4096)
    model_dir = build_base_model(texts, root / "model", spec=spec, vocab_size=700, min_frequency=1)

    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": t, "contents": c}) + "\n"
                              for i, (t, c) in enumerate(DOCS)))
    build_index_from_file(corpus, root / "bm25", "bm25")

    qa = pd.DataFrame([{"split": s, "id": i, "question": q, "ground_truth": gt, "data_source": "embedded"}
                       for s, i, q, gt in QUESTIONS])
    data = root / "verl"
    data.mkdir()
    verl_rows(qa, "train", template, "spader_search").to_parquet(data / "train.parquet")
    verl_rows(qa, "validation", template, "spader_search").to_parquet(data / "validation.parquet")

    with running_service(root / "bm25") as url:
        yield {"root": root, "model": model_dir, "data": data, "url": url}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    with trainer_loop_workspace(tmp_path_factory.mktemp("verl-loop")) as ws:
        yield ws


@contextmanager
def ray_for_trainer_loop(model_dir, *, paths=(), modules=(), env=None):
    """A local Ray whose workers find the test helpers (and ``paths``) on PYTHONPATH and load the
    plugin only through the launcher's ``VERL_USE_EXTERNAL_MODULES`` (entry points off), plus
    ``modules`` (e.g. a module defining another method); yields the scripted LLM server."""
    from spader_pipeline.launch.verl import verl_environment

    if ray.is_initialized():
        ray.shutdown()
    pythonpath = [str(HERE), *map(str, paths), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    launch_env = verl_environment(tracking_uri=None, run_id=None, base={})
    env = {
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VERL_LOGGING_LEVEL": "WARN",
        "VERL_USE_EXTERNAL_MODULES": ",".join([launch_env["VERL_USE_EXTERNAL_MODULES"], *modules]),
        "VERL_USE_EXTERNAL_PLUGINS": "none",
        **dict(env or {}),
    }
    # Through the environment Ray's own processes inherit, not a job runtime_env: a job with one gets
    # fresh workers set up for it, and the workers Ray pre-starts at init would sit idle (each is a
    # Python process importing ray); without one they host the first actors.
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield start_scripted_server(str(model_dir), PROMPT_LENGTH, RESPONSE_LENGTH, MAX_MODEL_LEN)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(workspace):
    """One local Ray for the four methods and the toy: the runs prove that what the launch forwards
    registers everything in verl's workers, and that a user's method module (``VERL_USE_EXTERNAL_MODULES``)
    reaches them the same way."""
    with ray_for_trainer_loop(workspace["model"], paths=[HERE.parent / "algorithms"], modules=["toy_method"],
                              env={WORKER_FLAG: "1"}) as server:
        yield server


def project_parameters() -> dict:
    from kedro.config import OmegaConfigLoader

    return OmegaConfigLoader(str(ROOT / "conf"), base_env="base", default_run_env="base")["parameters"]


def method_block(method: str) -> dict:
    """``train_<method>.method`` of the project's parameters, its tool cost scaled to :data:`TOOL_COST`."""
    block = dict(project_parameters()[f"train_{method}"]["method"])
    reward = dict(block.get("reward") or {})
    if reward.get("tool_round_cost"):
        reward["tool_round_cost"] = TOOL_COST
    return {**block, "reward": reward}


def pays_tool_cost(method: str) -> bool:
    return bool(method_block(method)["reward"].get("tool_round_cost"))


def _compose(method: str, ws: dict, run_dir: Path, *, config_dir: Path = ROOT / "conf/base/verl",
             block: dict | None = None):
    """``<config_dir>/method.yaml`` + the launcher's overrides (``spader_method=<method>``, …) for its
    ``train_<method>.method`` block (or ``block``) + CPU-test sizes, composed by Hydra."""
    from hydra import compose, initialize_config_dir

    from spader_pipeline.launch.overrides import build_overrides, overlay_name
    from spader_pipeline.launch.verl import verl_parameters, write_tool_config

    tool_config = write_tool_config(ROOT / "conf/base/verl/tool_config/search_tool.yaml", ws["url"],
                                    run_dir / "search_tool.yaml")
    shared = project_parameters()["training"]
    training = {
        "reward": {**shared["reward"], "cost_free_steps": FREE_STEPS, "cost_rampup_steps": 0},
        # the shared validation block, mapped by the launcher to test_freq / val_before_train / val_kwargs
        "validation": {"every": 2, "before_train": True, "max_questions": None},
        "verl": {
            "train_files": str(ws["data"] / "train.parquet"),
            "val_files": str(ws["data"] / "validation.parquet"),
            "n_gpus_per_node": 1,
            "nnodes": 1,
            "logger": ["file"],
            "total_training_steps": 2,
            "config_dir": str(ROOT / "conf/base/verl"),
            "overrides": [
                "data.train_batch_size=2",
                f"data.max_prompt_length={PROMPT_LENGTH}",
                f"data.max_response_length={RESPONSE_LENGTH}",
                "data.dataloader_num_workers=0",
                "actor_rollout_ref.rollout.n=4",
                f"actor_rollout_ref.rollout.max_model_len={MAX_MODEL_LEN}",
                # SPADER's group terms run with 2 workers: verl pads the 3 validation prompts to 4
                f"actor_rollout_ref.rollout.agent.num_workers={2 if method == 'spader' else 1}",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
                "+actor_rollout_ref.rollout.checkpoint_manager_class=verl_cpu_boundary.NoopCheckpointManager",
                "reward.num_workers=1",
                "trainer.save_freq=-1",
                "trainer.resume_mode=disable",
                "trainer.device=cpu",
            ],
        },
    }
    params = verl_parameters({"path": str(ws["model"])}, block or method_block(method), training, run_dir,
                             tool_config_path=tool_config)
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=overlay_name(params), overrides=build_overrides(params))


def run_trainer_loop(method: str, ws: dict, run_dir: Path, **compose) -> tuple[list[dict], object]:
    """verl's ``main()`` checks and ``TaskRunner.run`` with the GPU boundaries replaced; returns the
    metrics verl's file tracker logged and the composed config (``compose``: see :func:`_compose`)."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner, TaskRunner
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    config = _compose(method, ws, run_dir, **compose)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))

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
    metrics_path = run_dir / "metrics.jsonl"
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    try:
        CpuTaskRunner().run(config)
    finally:
        os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        # verl names its workers (reward_loop_worker_0, ...): free the names for the next method
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["name"] == SERVER_NAME:
                continue
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            except ValueError:  # it exited between the listing and the lookup: its name is free
                pass
    return [json.loads(line) for line in metrics_path.read_text().splitlines()], config


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
                "group/first_divergence_turn", "group/identical_frac"):
        assert [step for step, _ in logged[key]] == [1, 2], (key, logged.get(key))
    assert all(n >= 1 for _, n in logged["group/distinct_query_seqs"])
    # validation curves under the native trainer's names, before training and at test_freq (step 2)
    for key in ("val/embedded/recall", "val/embedded/f1", "val/embedded/searches"):
        assert [step for step, _ in logged[key]] == [0, 2], (key, logged.get(key))
        assert all(0.0 <= v for _, v in logged[key])
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
