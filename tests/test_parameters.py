"""Settings that must agree across stages are written once in conf/ (anchors and interpolation)."""

from __future__ import annotations

from kedro.config import OmegaConfigLoader


def test_trajectory_limits_are_written_once(project_root):
    params = OmegaConfigLoader(str(project_root / "conf"), base_env="base", default_run_env="base",
                               merge_strategy={"parameters": "soft"})["parameters"]
    limits = params["training"]["rollout"]
    assert {"max_turns", "topk", "max_observation_chars"} <= set(limits)
    assert params["training"]["native"]["rollout"] == limits  # RL rollouts
    assert params["warm_start"]["rollout"] == limits  # demonstrations
    assert params["evaluate"]["trained_models"]["rollout"] == limits  # evaluation of the trained models


def test_every_environment_builds_a_valid_native_trainer_for_every_method(project_root):
    """Each environment's training settings make a valid NativeTrainerConfig for each method block
    (e.g. micro-batches that divide the step's trajectories): wrong ones fail here, not after a
    14-minute warm start."""
    import pytest

    from spader_pipeline.algorithms.validation import ValidationSettings
    from spader_pipeline.native import NativeTrainerConfig
    from spader_pipeline.settings import CONFIG_LOADER_ARGS
    from spader_pipeline.typed_config import from_mapping, method_settings

    envs = sorted(p.name for p in (project_root / "conf").iterdir()
                  if p.is_dir() and p.name not in ("base", "local"))
    assert {"compare", "positive_control", "one_gpu", "test"} <= set(envs)
    for env in envs:
        params = OmegaConfigLoader(str(project_root / "conf"), **{**CONFIG_LOADER_ARGS, "default_run_env": env})[
            "parameters"]
        training = params["training"]
        try:
            from_mapping(ValidationSettings, training.get("validation"), where="training.validation")
        except (TypeError, ValueError) as err:
            pytest.fail(f"conf/{env}, training.validation: {err}")
        methods = {k: v["method"] for k, v in params.items() if k.startswith("train_") and "method" in (v or {})}
        assert methods, env
        for name, method in methods.items():
            try:
                NativeTrainerConfig.from_mapping(method_settings(training, method, "native"))
            except (TypeError, ValueError) as err:
                pytest.fail(f"conf/{env}, {name}: {err}")
