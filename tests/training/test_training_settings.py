"""``training`` typed once: every unknown key and every bad value stops with the key's full path and
what it takes, before anything runs; the backend is a table; the trainer's configuration is built once;
both backends read the same typed method."""

from __future__ import annotations

import pytest
import yaml

from spader_pipeline.native import config as native_config
from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.training import TrainingSettings
from spader_pipeline.training.registry import BACKENDS, get_backend, register_backend
from spader_pipeline.typed_config import SettingsError


@pytest.fixture(scope="module")
def conf(project_root):
    """``training`` and the method blocks of conf/base, as Kedro reads them (YAML anchors resolved)."""
    params = yaml.safe_load((project_root / "conf/base/parameters_training.yml").read_text())
    params["training"]["output_dir"] = "data/06_models"  # the only interpolation in the block
    return params


def test_the_base_settings_type_with_every_method(conf):
    for name in ("grpo", "spader", "calibadv", "tspo"):
        settings = TrainingSettings.from_mapping(conf["training"], conf[f"train_{name}"]["method"])
        config = settings.trainer_config(device="cpu")
        assert isinstance(config, NativeTrainerConfig) and config.method == name and config.device == "cpu"
        assert settings.run_dir().name == f"train_{name}" and settings.validation.max_questions == 16
    spader = TrainingSettings.from_mapping(conf["training"], conf["train_spader"]["method"])
    assert spader.trainer_config().reward.tool_round_cost == 0.01 and spader.trainer_config().options.gamma == 0.9
    assert spader.method_parameters()["reward"]["cost_free_steps"] == 100  # the shared value under the method's


@pytest.mark.parametrize(("change", "message"), [
    ({"natvie_typo": 1}, r"unknown training settings \['natvie_typo'\] \(training.natvie_typo\); known: \[.*'backend'"),
    ({"native": {"total_stepz": 3}}, r"training.native.total_stepz\); known: \[.*'total_steps'"),
    ({"validation": {"evry": 2}}, r"training.validation.evry"),
    ({"search": {"host": "x"}}, r"training.search.host"),
    ({"verl": {"overlay": "x"}}, r"training.verl.overlay"),
    ({"verl": {"ppo_epochz": 2}}, r"unknown training.verl settings \['ppo_epochz'\] \(training.verl.ppo_epochz\); "
                                  r"known: \[.*'overrides'"),
    ({"rollout": {"max_turn": 3}}, r"training.rollout.max_turn"),
    ({"native": {"rollout": {"max_turn": 3}}}, r"training.native.rollout.max_turn"),
    ({"native": {"method": "grpo"}}, r"training.native.method\); known: \[(?!.*'method')"),
    ({"reward": {"alpah": 1.0}}, r"training.reward.alpah\); known: \[.*'alpha'"),
], ids=["top-level", "native", "validation", "search", "verl", "verl-ppo_epochz", "rollout", "native-rollout",
        "native-method", "reward"])
def test_an_unknown_key_names_its_full_path_and_the_known_ones(conf, change, message):
    training = {**conf["training"], **{k: ({**conf["training"].get(k, {}), **v} if isinstance(v, dict) else v)
                                       for k, v in change.items()}}
    with pytest.raises(SettingsError, match=message):
        TrainingSettings.from_mapping(training, conf["train_spader"]["method"])


@pytest.mark.parametrize(("change", "message"), [
    ({"backend": "tpu"}, r"training.backend='tpu': use one of \['native', 'verl'\]"),
    ({"subprocess": "yes"}, r"training.subprocess='yes': expected true or false"),
    ({"max_train_questions": 2.5}, r"training.max_train_questions=2.5: expected an integer or null"),
    ({"native": {"total_steps": "3"}}, r"training.native.total_steps='3': expected an integer"),
    ({"native": {"loss_agg_mode": "sum"}}, r"training.native with train_spader.method: loss_agg_mode='sum' is not one of \('token-mean'"),
    ({"reward": {"alpha": "high"}}, r"training.reward.alpha='high': expected a number"),
    ({"validation": {"every": -1}}, r"training.validation: validation.every=-1: use 0 \(never\)"),
    ({"search": {"mode": "remote"}}, r"training.search: retrieval mode must be 'local' or 'service', got 'remote'"),
], ids=["backend", "subprocess", "max_train_questions", "native-type", "native-value", "reward-type", "validation",
        "search"])
def test_a_bad_value_names_its_full_path_and_what_it_takes(conf, change, message):
    training = {**conf["training"], **{k: ({**conf["training"].get(k, {}), **v} if isinstance(v, dict) else v)
                                       for k, v in change.items()}}
    with pytest.raises(SettingsError, match=message):
        TrainingSettings.from_mapping(training, conf["train_spader"]["method"])


def test_a_method_block_is_checked_by_the_backend_that_reads_it(conf):
    with pytest.raises(SettingsError, match=r"unknown train_spader.method settings \['totl_steps'\]"):
        TrainingSettings.from_mapping(conf["training"], {**conf["train_spader"]["method"], "totl_steps": 3})
    with pytest.raises(SettingsError, match=r"unknown train_spader.method.options settings \['gama'\] \(train_spader.method.options.gama\)"):
        TrainingSettings.from_mapping(conf["training"], {"method": "spader", "options": {"gama": 0.9}})
    verl = {**conf["training"], "backend": "verl"}
    with pytest.raises(SettingsError, match=r"unknown train_spader.method.options settings \['gama'\]"):
        TrainingSettings.from_mapping(verl, {"method": "spader", "options": {"gama": 0.9}})
    with pytest.raises(SettingsError, match="needs its `method`"):
        TrainingSettings.from_mapping(conf["training"], {"reward": {}})


def test_the_backend_is_a_table_of_the_functions_that_train():
    assert sorted(BACKENDS) == ["native", "verl"]
    assert get_backend("native").validates_start_model and not get_backend("verl").validates_start_model
    with pytest.raises(SettingsError, match=r"use one of \['native', 'verl'\]"):
        get_backend("tpu")
    with pytest.raises(ValueError, match="already registered"):
        register_backend("native", validates_start_model=True)(lambda *a, **k: ({}, []))


def test_settings_pass_through_and_take_a_method_later(conf):
    shared = TrainingSettings.from_mapping(conf["training"])
    assert shared.method is None and shared.start_config().total_steps == 2
    grpo = TrainingSettings.from_mapping(shared, conf["train_grpo"]["method"])
    assert grpo.method_name == "grpo" and grpo.trainer_config().method == "grpo" and grpo.seed == 0


def test_the_settings_build_the_trainer_config_once(conf, monkeypatch):
    """Typing the settings builds one configuration (the method's), which every later read returns."""
    built = []
    original = native_config.NativeTrainerConfig.__post_init__
    monkeypatch.setattr(native_config.NativeTrainerConfig, "__post_init__",
                        lambda self: built.append(self.method) or original(self))
    settings = TrainingSettings.from_mapping(conf["training"], conf["train_spader"]["method"])
    assert built == ["spader"]
    assert settings.trainer_config() is settings.trainer and settings.seed == 0 and built == ["spader"]
    assert settings.trainer_config(device="cpu").device == "cpu" and settings.trainer.device == "auto"


def test_both_backends_read_one_typed_method(conf):
    """verl's launch reads the method, its reward settings and options from the trainer's configuration:
    the values the native trainer trains with, not the mapping again."""
    verl = TrainingSettings.from_mapping({**conf["training"], "backend": "verl"}, conf["train_spader"]["method"])
    launch = verl.verl_launch()
    assert launch.method == "spader" and launch.reward == verl.trainer.reward and launch.options.gamma == 0.9
    assert launch.reward.tool_round_cost == 0.01 and launch.reward.cost_free_steps == 100
    assert launch.validation is verl.validation and launch.verl is verl.verl
    grpo = TrainingSettings.from_mapping(conf["training"], conf["train_grpo"]["method"]).verl_launch()
    assert grpo.reward.tool_round_cost == 0.0 and not grpo.reward.enable_exploration


def test_a_changed_copy_is_typed_again(conf):
    """A compare cell's seed and folder, the positive control's validation: changed on the typed
    settings and checked as the YAML is."""
    shared = TrainingSettings.from_mapping(conf["training"])
    cell = shared.with_changes(native={"seed": 3}, output_dir="out/seed3", verl_overrides=("data.seed=3",),
                               validation={"max_questions": None})
    assert cell.trainer.seed == 3 and cell.output_dir == "out/seed3" and cell.validation.max_questions is None
    assert cell.verl.overrides[-1] == "data.seed=3" and shared.trainer.seed == 0
    with pytest.raises(SettingsError, match=r"training.native.seeed"):
        shared.with_changes(native={"seeed": 3})
