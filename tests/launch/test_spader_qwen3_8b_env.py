"""``conf/spader_qwen3_8b``, the SPADER reference setup on one 8-GPU node (docs/gpu.md): it composes
with Kedro's config loader, every path follows ``data_root``, a missing input fails with a message
that names it, the verl command it builds composes to the reference's values (field by field, from
shared/reference/spader_reference_spec.md §1.5, §1.8, §3.3, §4.3 and §10), and evaluation runs
under the limits verl trains under."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from kedro.config import OmegaConfigLoader
from kedro.io import DataCatalog

from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.evaluation.config import EvaluationConfig
from spader_pipeline.evaluation.models import ModelSpec
from spader_pipeline.launch.command import build_launch
from spader_pipeline.launch.settings import verl_settings
from spader_pipeline.settings import CONFIG_LOADER_ARGS
from spader_pipeline.training import TrainingSettings

ROOT = Path(__file__).resolve().parents[2]
ENV = "spader_qwen3_8b"
#: the pipelines docs/gpu.md runs in this environment, in order
ENV_PIPELINES = ("data_prep", "index_build", "base_model", "warm_start", "train_grpo", "train_spader", "merge",
                 "evaluate", "report")


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A copy of the project's conf/ whose environment puts ``data_root`` on another disk, as a
    node's would be; the working directory is the copy's root (config paths are project-relative)."""
    shutil.copytree(ROOT / "conf", tmp_path / "conf", ignore=shutil.ignore_patterns("local"))
    data_root = tmp_path / "disk" / "spader"
    (tmp_path / "conf" / ENV / "globals.yml").write_text(f"data_root: {data_root}\n")
    monkeypatch.chdir(tmp_path)
    loader = OmegaConfigLoader(str(tmp_path / "conf"), env=ENV,
                               **{k: v for k, v in CONFIG_LOADER_ARGS.items() if k != "default_run_env"})
    return {"root": tmp_path, "data_root": data_root, "params": loader["parameters"], "catalog": loader["catalog"]}


def _strings(value, where=""):
    """(where, string) of every string leaf of a nested config."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value


#: strings with a slash that are not files this environment reads or writes
NOT_PATHS = {"base_model.packaged.file", "base_model.packaged.model_name"}  # the unused SmolLM2 wheel


def test_every_path_of_the_environment_follows_data_root(node):
    data_root = str(node["data_root"])
    for config in ("params", "catalog"):
        paths = [(where, s) for where, s in _strings(node[config])  # one word with a slash, not a URL
                 if "/" in s and not any(c.isspace() for c in s) and "://" not in s and where not in NOT_PATHS]
        assert paths, config
        outside = [(where, s) for where, s in paths if not s.startswith(data_root)]
        assert not outside, f"{config} paths outside data_root: {outside}"
    # the files a node supplies by hand, where docs/gpu.md says to put them
    params = node["params"]
    assert params["base_model"]["path"] == f"{data_root}/models/Qwen3-8B"
    assert [b["path"] for b in params["data_prep"]["benchmarks"]] == [
        f"{data_root}/01_raw/qampari/{name}_data.jsonl" for name in ("train", "dev", "test")]
    assert node["catalog"]["corpus"]["filepath"] == f"{data_root}/01_raw/qampari_wikipedia_2021/corpus.jsonl"
    assert params["index_build"]["dense"]["model_path"] == f"{data_root}/models/e5-base-v2"


def test_environment_composes_into_the_projects_typed_settings(node):
    params = node["params"]
    assert params["training"]["backend"] == "verl" and params["warm_start"]["enabled"] is False
    assert params["prompt"]["template"] == "spader"  # the reference prompt, verbatim
    assert params["data_prep"]["verl"]["sources"] == ["qampari"]
    assert {b["split"] for b in params["data_prep"]["benchmarks"]} == {"train", "validation", "test"}
    assert all(b["optional"] is False for b in params["data_prep"]["benchmarks"])
    settings = verl_settings(params["training"]["verl"])
    assert (settings.model, settings.n_gpus_per_node, settings.nnodes) == ("qwen3_8b", 8, 1)
    assert (settings.train_files, settings.val_files) == (None, None)  # the catalog's datasets
    config = EvaluationConfig.from_mapping(params["evaluate"])
    assert config.datasets == ("qampari_test",) and config.max_samples is None
    # the warm start and the in-process stages pick CUDA when present
    assert params["warm_start"]["device"] == "auto" and params["training"]["native"]["device"] == "auto"
    # the catalog builds (dataset factories included), with the corpus streamed from data_root
    catalog = DataCatalog.from_config(node["catalog"])
    assert "corpus" in catalog.keys()
    # BM25 by default; the dense e5 index on faiss-gpu is one switch away
    index = params["index_build"]
    assert index["method"] == "bm25" and (index["bm25"]["k1"], index["bm25"]["b"]) == (0.9, 0.4)
    assert index["dense"]["faiss_gpu"] is True and index["dense"]["device"] == "cuda"
    assert (index["dense"]["query_prefix"], index["dense"]["passage_prefix"]) == ("query: ", "passage: ")
    assert index["rerank"]["model_path"] is None  # the bge reranker is optional, as in the reference


def test_missing_inputs_fail_with_a_message_naming_them(node):
    from spader_pipeline.pipelines.base_model.nodes import provide_base_model
    from spader_pipeline.pipelines.data_prep.nodes import read_benchmarks

    params = node["params"]
    with pytest.raises(FileNotFoundError, match=r"base_model.path=.*/models/Qwen3-8B .*no config.json"):
        provide_base_model(None, params["base_model"], params["prompt"])
    with pytest.raises(FileNotFoundError, match=r"'qampari_train': required file .*/01_raw/qampari/train_data.jsonl"):
        read_benchmarks(params["data_prep"]["benchmarks"])
    with pytest.raises(Exception, match=r"qampari_wikipedia_2021/corpus.jsonl does not exist"):
        DataCatalog.from_config(node["catalog"]).load("corpus")


def _composed_launch(node, method="spader"):
    """The launch the train_<method> node builds here, and the config verl composes from it (Hydra
    in process, as ``main_ppo`` does with the same config dir, name and overrides)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import spader_pipeline.verl_plugin  # noqa: F401  (the Hydra group spader_method)

    params = node["params"]
    model = node["data_root"] / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    frames = {split: pd.DataFrame({"data_source": ["qampari"], "prompt": [[{"role": "user", "content": split}]]})
              for split in ("train", "validation")}
    run_dir = Path(params["training"]["output_dir"]) / f"train_{method}"  # as the training node names it
    method_launch = TrainingSettings.from_mapping(params["training"], params[f"train_{method}"]["method"]).verl_launch()
    launch = build_launch({"path": str(model)}, method_launch, run_dir,
                          retrieval_url="http://127.0.0.1:8123", tracking_uri="sqlite:////tmp/x.db", run_id="r1",
                          **frames)
    argv = launch.argv
    name = argv.index("--config-name")
    with initialize_config_dir(config_dir=argv[argv.index("--config-path") + 1], version_base=None):
        cfg = compose(config_name=argv[name + 1], overrides=argv[name + 2:])
    return launch, OmegaConf.to_container(cfg, resolve=True), frames


@pytest.mark.slow
def test_verl_command_is_the_reference_setup_field_by_field(node):
    launch, cfg, frames = _composed_launch(node)
    data_root, run_dir = node["data_root"], node["data_root"] / "06_models" / "train_spader"
    assert launch.argv[1:3] == ["-m", "verl.trainer.main_ppo"]
    data, actor_rollout_ref = cfg["data"], cfg["actor_rollout_ref"]
    actor, rollout, ref = actor_rollout_ref["actor"], actor_rollout_ref["rollout"], actor_rollout_ref["ref"]
    expected = {
        # model and data: Qwen3-8B; QAMPARI parquet from the catalog, written under data_root
        "model.path": (actor_rollout_ref["model"]["path"], str(data_root / "models" / "Qwen3-8B")),
        "data.train_files": (data["train_files"], str(run_dir / "data" / "train.parquet")),
        "data.val_files": (data["val_files"], str(run_dir / "data" / "validation.parquet")),
        "data.train_batch_size": (data["train_batch_size"], 32),
        "data.max_prompt_length": (data["max_prompt_length"], 512),
        "data.max_response_length": (data["max_response_length"], 8192),
        "data.filter_overlong_prompts": (data["filter_overlong_prompts"], True),
        "data.truncation": (data["truncation"], "error"),
        "data.return_raw_chat": (data["return_raw_chat"], True),
        "data.shuffle": (data["shuffle"], False),
        # actor: FSDP, AdamW 1e-5 with 5% warm-up, one optimiser step per training step
        "actor.strategy": (actor["strategy"], "fsdp"),
        "actor.optim.lr": (actor["optim"]["lr"], 1.0e-5),
        "actor.optim.lr_warmup_steps_ratio": (actor["optim"]["lr_warmup_steps_ratio"], 0.05),
        "actor.optim.lr_scheduler_type": (actor["optim"]["lr_scheduler_type"], "constant"),
        "actor.optim.betas": (actor["optim"]["betas"], [0.9, 0.999]),
        "actor.optim.weight_decay": (actor["optim"]["weight_decay"], 0.01),
        "actor.grad_clip": (actor["grad_clip"], 1.0),
        "actor.ppo_mini_batch_size": (actor["ppo_mini_batch_size"], 32),
        "actor.ppo_micro_batch_size_per_gpu": (actor["ppo_micro_batch_size_per_gpu"], 4),
        "actor.ppo_epochs": (actor["ppo_epochs"], 1),
        "actor.clip_ratio_low": (actor["clip_ratio_low"], 0.2),
        "actor.clip_ratio_high": (actor["clip_ratio_high"], 0.2),
        "actor.clip_ratio_c": (actor["clip_ratio_c"], 3.0),
        "actor.loss_agg_mode": (actor["loss_agg_mode"], "token-mean"),
        "actor.entropy_coeff": (actor["entropy_coeff"], 0),
        "actor.use_kl_loss": (actor["use_kl_loss"], True),
        "actor.kl_loss_coef": (actor["kl_loss_coef"], 0.001),
        "actor.kl_loss_type": (actor["kl_loss_type"], "low_var_kl"),
        "actor.fsdp_config.dtype": (actor["fsdp_config"]["dtype"], "bfloat16"),
        "actor.fsdp_config.param_offload": (actor["fsdp_config"]["param_offload"], False),
        "actor.fsdp_config.optimizer_offload": (actor["fsdp_config"]["optimizer_offload"], False),
        "model.use_remove_padding": (actor_rollout_ref["model"]["use_remove_padding"], True),
        "model.enable_gradient_checkpointing": (actor_rollout_ref["model"]["enable_gradient_checkpointing"], True),
        "ref.log_prob_micro_batch_size_per_gpu": (ref["log_prob_micro_batch_size_per_gpu"], 4),
        "ref.fsdp_config.dtype": (ref["fsdp_config"]["dtype"], "bfloat16"),
        # rollout: SGLang, async, 16 samples per prompt at temperature 1, greedy validation
        "rollout.name": (rollout["name"], "sglang"),
        "rollout.mode": (rollout["mode"], "async"),
        "rollout.n": (rollout["n"], 16),
        "rollout.temperature": (rollout["temperature"], 1.0),
        "rollout.top_p": (rollout["top_p"], 1),
        "rollout.top_k": (rollout["top_k"], -1),
        "rollout.max_model_len": (rollout["max_model_len"], 8704),
        "rollout.tensor_model_parallel_size": (rollout["tensor_model_parallel_size"], 1),
        "rollout.gpu_memory_utilization": (rollout["gpu_memory_utilization"], 0.6),
        "rollout.log_prob_micro_batch_size_per_gpu": (rollout["log_prob_micro_batch_size_per_gpu"], 4),
        "rollout.multi_turn.enable": (rollout["multi_turn"]["enable"], True),
        "rollout.multi_turn.max_assistant_turns": (rollout["multi_turn"]["max_assistant_turns"], 16),
        "rollout.multi_turn.max_user_turns": (rollout["multi_turn"]["max_user_turns"], None),
        "rollout.multi_turn.max_parallel_calls": (rollout["multi_turn"]["max_parallel_calls"], 1),
        "rollout.multi_turn.max_tool_response_length": (rollout["multi_turn"]["max_tool_response_length"], 11000),
        "rollout.multi_turn.tool_response_truncate_side": (rollout["multi_turn"]["tool_response_truncate_side"], "left"),
        "rollout.val_kwargs.do_sample": (rollout["val_kwargs"]["do_sample"], False),
        "rollout.val_kwargs.temperature": (rollout["val_kwargs"]["temperature"], 0),
        "rollout.val_kwargs.n": (rollout["val_kwargs"]["n"], 1),
        # SPADER: step-wise peer advantage (the reference's masked_step_grpo) with gamma 0.9 and the
        # exploration reward alpha 1, beta 4, lambda 1, tool cost 0.01 after 100 free + 100 ramp-up steps
        "algorithm.adv_estimator": (cfg["algorithm"]["adv_estimator"], "spa"),
        "algorithm.spa.gamma": (cfg["algorithm"]["spa"]["gamma"], 0.9),
        "algorithm.use_kl_in_reward": (cfg["algorithm"]["use_kl_in_reward"], False),
        "reward.reward_manager.name": (cfg["reward"]["reward_manager"]["name"], "spader"),
        **{f"reward.reward_kwargs.{k}": (cfg["reward"]["reward_kwargs"][k], v) for k, v in {
            "alpha": 1.0, "beta": 4.0, "lam": 1.0, "tool_round_cost": 0.01, "cost_free_steps": 100,
            "cost_rampup_steps": 100, "final_answer_weight": 1.0}.items()},
        # trainer: one 8-GPU node, one epoch, validation before training and every 50 steps on the
        # whole dev split, a checkpoint every 100 steps, everything under the run folder
        "trainer.n_gpus_per_node": (cfg["trainer"]["n_gpus_per_node"], 8),
        "trainer.nnodes": (cfg["trainer"]["nnodes"], 1),
        "trainer.total_epochs": (cfg["trainer"]["total_epochs"], 1),
        "trainer.save_freq": (cfg["trainer"]["save_freq"], 100),
        "trainer.test_freq": (cfg["trainer"]["test_freq"], 50),
        "trainer.val_before_train": (cfg["trainer"]["val_before_train"], True),
        "data.val_max_samples": (data["val_max_samples"], -1),
        "trainer.default_local_dir": (cfg["trainer"]["default_local_dir"], str(run_dir / "checkpoints")),
        "trainer.validation_data_dir": (cfg["trainer"]["validation_data_dir"], str(run_dir / "eval")),
        "trainer.rollout_data_dir": (cfg["trainer"]["rollout_data_dir"], str(run_dir / "rollouts")),
    }
    wrong = {key: got for key, (got, want) in expected.items() if got != want}
    assert not wrong, f"differs from the reference setup: {wrong}"
    # 32 prompts x 16 samples = 512 trajectories and one optimiser step per training step
    assert data["train_batch_size"] * rollout["n"] == 512 and actor["ppo_mini_batch_size"] == data["train_batch_size"]
    # the search tool (spec §1.5): top 5, 10,000 characters per call, the reference client's 90 s x 10 retries
    tool = yaml.safe_load(Path(rollout["multi_turn"]["tool_config_path"]).read_text())["tools"][0]["config"]
    assert (tool["topk"], tool["max_chars"], tool["max_observation_chars"]) == (5, 10000, 11000)
    assert (tool["timeout"], tool["max_retries"], tool["retrieval_service_url"]) == (90.0, 10, "http://127.0.0.1:8123")
    # verl reads the very rows the node was given
    for split, key in (("train", "train_files"), ("validation", "val_files")):
        pd.testing.assert_frame_equal(pd.read_parquet(data[key]), frames[split])


@pytest.mark.slow
def test_evaluation_limits_are_the_ones_verl_trains_under(node):
    """The agent loop's limits on verl (what ``SearchAgentLoop`` builds from the composed config and
    the tool config) equal every catalog model's evaluation limits; the served model's context is
    verl's prompt + response window, and each turn may use the rest of it, as on verl."""
    _, cfg, _ = _composed_launch(node)
    rollout = cfg["actor_rollout_ref"]["rollout"]
    tool = yaml.safe_load(Path(rollout["multi_turn"]["tool_config_path"]).read_text())["tools"][0]["config"]
    trained = RolloutConfig(max_turns=rollout["multi_turn"]["max_assistant_turns"],
                            max_response_tokens=cfg["data"]["max_response_length"], topk=tool["topk"],
                            max_chars=tool["max_chars"],
                            max_observation_chars=rollout["multi_turn"]["max_tool_response_length"],
                            max_queries_per_call=tool["max_queries_per_call"])
    config = EvaluationConfig.from_mapping(node["params"]["evaluate"])
    for name in ("base", "grpo", "spader"):
        spec = ModelSpec.from_manifest(name, {"path": "/merged"}, config.catalog_settings(name), source="test")
        assert spec.kind == "served" and spec.engine == "vllm"
        assert RolloutConfig.from_mapping(spec.rollout) == trained, name
        assert spec.sampling["temperature"] == 0.0  # greedy, as verl validates
        args = spec.options["server_args"]
        window = cfg["data"]["max_prompt_length"] + cfg["data"]["max_response_length"]
        assert int(args[args.index("--max-model-len") + 1]) == window == rollout["max_model_len"]
        assert spec.options["extra_body"] == {"max_tokens": None}  # each turn: the rest of the window
    assert not ModelSpec.from_manifest("warm_start", {"path": "/x"}, config.catalog_settings("warm_start"),
                                       source="test").enabled  # = the base model when the warm start is off


def test_registry_has_every_pipeline_the_environment_runs(project_root):
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(project_root)
    from spader_pipeline.pipeline_registry import register_pipelines

    pipelines = register_pipelines()
    assert set(ENV_PIPELINES) <= set(pipelines)
    (train,) = pipelines["train_spader"].nodes
    assert train.name == "train_spader.train_policy" and {"verl_train", "verl_validation"} <= set(train.inputs)
    assert "train_spader.merge_policy" in {node.name for node in pipelines["merge"].nodes}


@pytest.mark.slow
def test_kedro_registry_describe_lists_the_pipelines_of_the_environment(project_root):
    """``kedro registry describe`` (the CLI) shows what ``--env spader_qwen3_8b`` runs; pipelines are
    code, the same in every environment, so the command takes no ``--env``. One CLI start (the merge
    pipeline, from the same registry, is checked in-process by the test above)."""
    kedro = Path(sys.executable).with_name("kedro")
    proc = subprocess.run([str(kedro), "registry", "describe", "train_spader"], cwd=project_root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "train_spader.train_policy" in proc.stdout
