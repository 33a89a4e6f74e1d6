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
