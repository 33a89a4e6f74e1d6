"""conf/base/verl's one entry point, ``method.yaml``, and build_overrides: every method and model
composes with verl's own config through the launcher's overrides (in process; verl's real CLI,
``python -m verl.trainer.main_ppo ... --cfg job``, composes the launcher's command in
tests/launch/test_launch_verl.py::test_generated_command_composes_with_cfg_job)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402

import spader_pipeline.verl_plugin  # noqa: E402,F401  (the methods' settings: Hydra group spader_method)
from spader_pipeline.algorithms.methods import method_names  # noqa: E402
from spader_pipeline.launch.overrides import (  # noqa: E402
    METHOD_CONFIG,
    MODELS,
    build_overrides,
    main_ppo_argv,
    overlay_name,
)

CONF = Path(__file__).resolve().parents[2] / "conf" / "base" / "verl"
#: the SPADER paper's configs: GRPO and SPADER on each of its models
PAPER_RUNS = [(method, model) for model in MODELS for method in ("grpo", "spader")]


def _compose(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name=name, overrides=overrides or [])


def _diff(a, b, prefix=""):
    """Leaf keys whose values differ between two plain dicts."""
    keys = set(a) | set(b)
    out = set()
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out |= _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.add(f"{prefix}{k}")
    return out


@pytest.fixture(scope="module")
def composed():
    """Each paper run as the launcher composes it: ``method.yaml`` with the method's and model's overrides."""
    from omegaconf import OmegaConf

    return {(method, model): OmegaConf.to_container(_compose(METHOD_CONFIG, build_overrides({"method": method, "model": model})))
            for method, model in PAPER_RUNS}


def test_method_yaml_is_the_one_entry_point():
    """One way to launch verl: no hand-written config per method or model beside ``method.yaml``."""
    entry_points = sorted(p.name for p in CONF.glob("*.yaml") if "defaults:" in p.read_text())
    assert entry_points == [f"{METHOD_CONFIG}.yaml"]
    assert overlay_name({"method": "spader"}) == METHOD_CONFIG


def test_every_paper_run_composes_with_paper_settings(composed):
    for cfg in composed.values():
        assert cfg["reward"]["reward_manager"]["name"] == "spader"
        assert cfg["data"]["train_batch_size"] == 32 and cfg["actor_rollout_ref"]["rollout"]["n"] == 16
        assert cfg["data"]["max_response_length"] == 8192
        assert cfg["actor_rollout_ref"]["actor"]["kl_loss_coef"] == 0.001
        assert cfg["trainer"]["use_v1"] is False
        assert cfg["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_manager_class"].endswith(
            "GroupRewardAgentLoopManager"
        )
    assert composed[("spader", "qwen3_8b")]["algorithm"]["spa"]["gamma"] == 0.9
    assert composed[("spader", "llama3_8b")]["reward"]["reward_kwargs"]["cost_free_steps"] == 200
    assert composed[("spader", "qwen3_8b")]["reward"]["reward_kwargs"]["cost_free_steps"] == 100
    assert (
        composed[("spader", "llama3_8b")]["actor_rollout_ref"]["model"]["path"]
        == "meta-llama/Llama-3.1-8B-Instruct"
    )
    assert composed[("spader", "qwen3_8b")]["trainer"]["experiment_name"] == "spader"


def test_grpo_and_spader_differ_only_by_the_method(composed):
    """The SPADER reference's GRPO baseline also differed in format penalty, reward path and logging."""
    for model in MODELS:
        diff = _diff(composed[("grpo", model)], composed[("spader", model)])
        assert diff == {
            "algorithm.adv_estimator",
            "algorithm.spa",  # SPA's options
            "reward.reward_kwargs.method",
            "reward.reward_kwargs.tool_round_cost",  # per-method tool cost: SPADER pays it, GRPO does not
            "reward.reward_kwargs.alpha",
            "reward.reward_kwargs.beta",
            "reward.reward_kwargs.lam",
            "trainer.experiment_name",
        }, diff


def test_build_overrides_maps_parameters():
    params = {
        "method": "spader",
        "model": "llama3_8b",
        "model_path": "/models/warm start",
        "train_files": "data/05_model_input/verl/train.parquet",
        "n_gpus_per_node": 4,
        "run_dir": "/runs/x/",
        "logger": ["console", "mlflow"],
        "reward": {"lam": 0.5, "format_penalty": 0.0},
        "options": {"gamma": 0.9},
        "overrides": ["trainer.save_freq=7"],
    }
    out = build_overrides(params)
    assert out[:3] == ["spader_method=spader", "trainer.experiment_name=spader", "spader_model=llama3_8b"]
    assert "actor_rollout_ref.model.path='/models/warm start'" in out
    assert "trainer.n_gpus_per_node=4" in out and "trainer.logger=[console,mlflow]" in out
    assert "trainer.rollout_data_dir=/runs/x/rollouts" in out
    assert "++reward.reward_kwargs.lam=0.5" in out and "++algorithm.spa.gamma=0.9" in out
    assert out[-1] == "trainer.save_freq=7"
    argv = main_ppo_argv(params, CONF)
    assert argv[1:3] == ["-m", "verl.trainer.main_ppo"] and argv[argv.index("--config-name") + 1] == "method"
    cfg = _compose(overlay_name(params), out)
    assert cfg.reward.reward_kwargs.lam == 0.5 and cfg.reward.reward_kwargs.cost_free_steps == 200
    assert cfg.actor_rollout_ref.model.path == "/models/warm start" and cfg.trainer.save_freq == 7


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"method": "ppo"}, "method"),
        ({"method": "grpo", "reward": {"enable_exploration": True}}, "unknown reward"),
        ({"method": "spader", "reward": {"alpah": 1}}, "unknown reward"),
        ({"method": "spader", "reward": {"lambda_val": 1}}, "unknown reward"),
        ({"method": "spader", "options": {"gama": 1}}, "unknown spader options"),
        ({"method": "grpo", "options": {"gamma": 1}}, "unknown grpo options"),
        ({"method": "tspo", "options": {"outcome": "em"}}, "exact_match"),
        ({"method": "spader", "typo": 1}, "unknown verl parameters"),
        ({"method": "spader", "model": "gpt"}, "model"),
        ({"method": "spader", "overrides": "a=b"}, "list"),
    ],
)
def test_build_overrides_rejects_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        build_overrides(params)


def test_method_options_compose():
    cfg = _compose(
        "method",
        build_overrides({"method": "calibadv", "options": {"target_ratio": 1.5, "silver_threshold": 0.6}}),
    )
    # one place for a method's options, read by both the reward manager and the estimator
    assert cfg.algorithm.calibadv.target_ratio == 1.5 and cfg.algorithm.calibadv.silver_threshold == 0.6
    cfg = _compose("method", build_overrides({"method": "tspo", "options": {"latent_reward": 0.3}}))
    assert cfg.algorithm.tspo.latent_reward == 0.3


def test_every_registered_method_composes_from_the_registry_alone():
    """No overlay file per method: ``method.yaml`` + ``spader_method=<m>`` holds the method's
    estimator, its options' defaults and its reward manager settings, for every registered method."""
    for method in method_names():
        cfg = _compose(overlay_name({"method": method}), build_overrides({"method": method}))
        assert cfg.reward.reward_kwargs.method == method and cfg.trainer.experiment_name == method
        assert cfg.algorithm.adv_estimator == {"spader": "spa"}.get(method, method)
    assert _compose("method", ["spader_method=spader"]).algorithm.spa.gamma == 0.9
    assert _compose("method", ["spader_method=calibadv"]).algorithm.calibadv.target_ratio == 1.0
    assert _compose("method", ["spader_method=grpo"]).algorithm.norm_adv_by_std_in_grpo is True


def test_entry_point_is_declared_and_loads():
    """verl's own loop on `import verl` is ``for ep in entry_points(group="verl.plugins"): ep.load()``."""
    from importlib.metadata import entry_points

    import spader_pipeline.verl_plugin as plugin

    (ep,) = [ep for ep in entry_points(group="verl.plugins") if ep.name == "spader"]
    assert ep.value == "spader_pipeline.verl_plugin" and ep.load() is plugin



def test_validation_block_sets_verls_schedule_subset_and_greedy_decoding():
    """training.validation composes into verl's own validation keys (the native trainer's schedule)."""
    overrides = build_overrides({"method": "spader", "validation": {"every": 3, "before_train": True, "max_questions": 24}})
    cfg = _compose(METHOD_CONFIG, overrides)
    assert cfg.trainer.test_freq == 3 and cfg.trainer.val_before_train is True
    assert cfg.data.val_max_samples == 24 and cfg.data.validation_shuffle is False
    assert cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is False and cfg.actor_rollout_ref.rollout.val_kwargs.n == 1
    never = _compose(METHOD_CONFIG, build_overrides({"method": "spader", "validation": {"every": 0, "max_questions": None}}))
    assert never.trainer.test_freq == -1 and never.data.val_max_samples == -1
    with pytest.raises(ValueError, match="validation"):
        build_overrides({"method": "spader", "validation": {"every": -1}})
    with pytest.raises(ValueError, match="one batch"):  # a native-only setting is refused, not dropped
        build_overrides({"method": "spader", "validation": {"batch_size": {"fitted": 1}}})


def test_sampled_validation_is_verls_sampled_val_kwargs_at_the_rollouts_temperature():
    """``trajectories: n`` is verl's ``val_kwargs.n`` with sampling, at validation's temperature, else the
    rollout's (the last override that sets it); a per-source count, which verl cannot express, is refused."""
    rollout_at = ["actor_rollout_ref.rollout.temperature=0.7"]
    cfg = _compose(METHOD_CONFIG, build_overrides({"method": "grpo", "validation": {"trajectories": 5},
                                                   "overrides": rollout_at}))
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.do_sample, val.n, val.temperature) == (True, 5, 0.7)
    own = build_overrides({"method": "grpo", "validation": {"trajectories": 5, "temperature": 0.3}, "overrides": rollout_at})
    assert _compose(METHOD_CONFIG, own).actor_rollout_ref.rollout.val_kwargs.temperature == 0.3
    with pytest.raises(ValueError, match="one count"):
        build_overrides({"method": "grpo", "validation": {"trajectories": {"fitted": 5}}})
