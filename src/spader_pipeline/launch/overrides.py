"""Kedro parameters → ``python -m verl.trainer.main_ppo`` command line (pure, no verl import).

The Hydra config in ``conf/base/verl/`` (one entry point, ``method.yaml``, and its groups) holds the
paper settings and every method's settings come from the method registry (the Hydra group ``spader_method``,
:mod:`spader_pipeline.verl_plugin.method_configs`); ``build_overrides`` adds only what
a run chooses (data, model path, cluster size, output directories, method hyper-parameters), so every
GRPO-vs-SPADER difference stays visible in config (docs/training.md, "RL: the VERL backend").

Parameter dict (all keys optional except ``method``)::

    method: spader            # a method of spader_pipeline.algorithms.methods → spader_method=<method> on conf/base/verl/method.yaml
    model: qwen3_8b           # qwen3_8b | llama3_8b             → Hydra group spader_model
    model_path: /models/x     # actor_rollout_ref.model.path (a local checkpoint)
    train_files: ..., val_files: ...
    n_gpus_per_node: 8, nnodes: 1
    run_dir: /runs/x          # checkpoints/, eval/, rollouts/ under it
    project_name, experiment_name, total_training_steps, logger: [console, mlflow]
    tool_config_path, agent_loop_config_path
    reward: {...}             # SpaderRewardConfig fields (+ require_global_step) → reward.reward_kwargs
    options: {...}            # the method's options dataclass → algorithm[.<estimator>] (estimators.verl_options_path)
    validation: ValidationSettings  # algorithms.validation (or its mapping) →
                              # trainer.test_freq / val_before_train, data.val_max_samples, greedy val_kwargs
    overrides: ["key=value"]  # appended last, verbatim

Reward settings and method options are checked against the method registry
(:mod:`spader_pipeline.algorithms.methods`) with the same names the native trainer uses.

A method is one key: ``spader_method=<method>`` selects both the estimator (``algorithm.adv_estimator``)
and the reward layout (``reward.reward_kwargs.method``). An override that sets either apart from the
method (``algorithm.adv_estimator=grpo`` under ``spader_method=spader``, which would pair SPADER's
rewards with GRPO's estimator) is an error naming both keys (:func:`check_one_method_key`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spader_pipeline.algorithms.methods import (
    get_method,
    method_names,
    options_from_mapping,
    reward_config_from_mapping,
)
from spader_pipeline.typed_config import SettingsError

__all__ = [
    "MODELS",
    "METHOD_CONFIG",
    "VERL_REWARD_KEYS",
    "build_overrides",
    "check_one_method_key",
    "hydra_value",
    "main_ppo_argv",
    "native_design_overrides",
    "native_search_tool",
    "overlay_name",
]

MODELS = ("qwen3_8b", "llama3_8b")
#: the config the launcher composes: any method, selected by the group override ``spader_method``
METHOD_CONFIG = "method"
#: reward_kwargs the ``spader`` reward manager takes besides the reward config's fields
VERL_REWARD_KEYS = ("require_global_step",)
_TOP_LEVEL = {
    "method",
    "model",
    "model_path",
    "train_files",
    "val_files",
    "n_gpus_per_node",
    "nnodes",
    "run_dir",
    "project_name",
    "experiment_name",
    "total_training_steps",
    "logger",
    "tool_config_path",
    "agent_loop_config_path",
    "reward",
    "options",
    "validation",
    "overrides",
}


def _value(v: Any) -> str:
    """Render a Python value in Hydra's override grammar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"non-finite value {v!r} cannot be passed to verl")
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, Path):
        v = str(v)
    if isinstance(v, str):
        if v and all(c.isalnum() or c in "/._-:+@~" for c in v):
            return v
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    raise TypeError(f"cannot render {type(v).__name__} as a Hydra value: {v!r}")


#: public name of the value renderer (the launcher forwards environment variables with it)
hydra_value = _value


def overlay_name(params: Mapping[str, Any]) -> str:
    """Config name in ``conf/base/verl`` (:data:`METHOD_CONFIG`) after checking ``params['method']``;
    the method and the model are Hydra group overrides."""
    method = params.get("method")
    if method not in method_names():
        raise ValueError(f"params['method'] must be one of {method_names()}, got {method!r}")
    return METHOD_CONFIG


def build_overrides(params: Mapping[str, Any]) -> list[str]:
    """Turn a Kedro parameter dict into ``main_ppo`` Hydra overrides (see module docstring).

    Raises ``ValueError`` on unknown keys or values, so a typo never silently falls back to a default.
    """
    unknown = sorted(set(params) - _TOP_LEVEL)
    if unknown:
        raise ValueError(f"unknown verl parameters {unknown}; known: {sorted(_TOP_LEVEL)}")
    overlay_name(params)  # checks the method
    method = str(params["method"])
    out: list[str] = [f"spader_method={method}"]
    if params.get("experiment_name") is None:
        out.append(f"trainer.experiment_name={_value(method)}")
    model = params.get("model")
    if model is not None:
        if model not in MODELS:
            raise ValueError(f"params['model'] must be one of {MODELS}, got {model!r}")
        out.append(f"spader_model={model}")
    simple = {
        "model_path": "actor_rollout_ref.model.path",
        "train_files": "data.train_files",
        "val_files": "data.val_files",
        "n_gpus_per_node": "trainer.n_gpus_per_node",
        "nnodes": "trainer.nnodes",
        "project_name": "trainer.project_name",
        "experiment_name": "trainer.experiment_name",
        "total_training_steps": "trainer.total_training_steps",
        "logger": "trainer.logger",
        "tool_config_path": "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        "agent_loop_config_path": "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    }
    for key, target in simple.items():
        if params.get(key) is not None:
            out.append(f"{target}={_value(params[key])}")
    run_dir = params.get("run_dir")
    if run_dir is not None:
        run_dir = str(run_dir).rstrip("/")
        out += [
            f"trainer.default_local_dir={_value(run_dir + '/checkpoints')}",
            f"trainer.validation_data_dir={_value(run_dir + '/eval')}",
            f"trainer.rollout_data_dir={_value(run_dir + '/rollouts')}",
        ]

    reward = dict(params.get("reward") or {})
    reward_config_from_mapping(method, {k: v for k, v in reward.items() if k not in VERL_REWARD_KEYS})  # checks
    for key, value in reward.items():
        out.append(f"++reward.reward_kwargs.{key}={_value(value)}")

    from spader_pipeline.verl_plugin.estimators import verl_options_path  # imports verl: only when building

    options = dict(params.get("options") or {})
    options_from_mapping(method, options)  # checks names and values
    for key, value in options.items():
        out.append(f"++{verl_options_path(method)}.{key}={_value(value)}")

    extra = params.get("overrides") or []
    if isinstance(extra, str) or not isinstance(extra, Sequence):
        raise ValueError("params['overrides'] must be a list of 'key=value' strings")
    if params.get("validation") is not None:  # sampled at the rollout's temperature unless it names its own
        out += validation_overrides(params["validation"], _rollout_temperature([*out, *map(str, extra)]))
    out += [str(x) for x in extra]
    check_one_method_key(method, out)
    return out


#: the keys the method's one key (``spader_method``) decides, and what each must then hold
_METHOD_KEYS = {
    "spader_method": lambda method: method,
    "algorithm.adv_estimator": lambda method: get_method(method).estimator,
    "reward.reward_kwargs.method": lambda method: method,
}


def check_one_method_key(method: str, overrides: Sequence[str]) -> None:
    """Raise :class:`~spader_pipeline.typed_config.SettingsError` when ``overrides`` (a whole command
    line's, in order: the last value of a key wins, as in Hydra) set the method's estimator or reward
    layout apart from ``method``, naming the two keys that disagree."""
    final: dict[str, str] = {}
    for override in overrides:
        key, sep, value = str(override).lstrip("+~").partition("=")
        if sep and key in _METHOD_KEYS:
            final[key] = value.strip().strip("'\"")
    for key, value in final.items():
        expected = _METHOD_KEYS[key](method)
        if value != expected:
            raise SettingsError(
                f"the command line sets {key}={value}, but the method is {method} (spader_method={method}, "
                f"from train_<method>.method.method), which needs {key}={expected}: on verl a method is one key, "
                f"so {key} and spader_method may not disagree. Choose another method by its block's `method` "
                f"(or register one), not by {key} in training.verl.overrides")


def _rollout_temperature(overrides: Sequence[str]) -> float:
    """The rollout's sampling temperature the last of ``overrides`` sets, else verl's default (1.0)."""
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("actor_rollout_ref.rollout.temperature=")]
    return float(values[-1]) if values else 1.0


def validation_overrides(validation: Mapping[str, Any], temperature: float = 1.0) -> list[str]:
    """verl's validation schedule for ``training.validation``: the same steps, questions and decoding
    (greedy, or ``trajectories`` sampled at its temperature, else ``temperature``: the rollout's) as the
    native trainer (:class:`~spader_pipeline.algorithms.validation.ValidationSettings`)."""
    from spader_pipeline.algorithms.validation import ValidationSettings
    from spader_pipeline.typed_config import from_mapping

    settings = validation if isinstance(validation, ValidationSettings) else from_mapping(
        ValidationSettings, validation, where="training.validation")
    if settings.batch_size is not None:
        raise ValueError(f"training.validation.batch_size={settings.batch_size}: verl validates its questions in "
                         "one batch; remove the setting (null) for the verl backend")
    if isinstance(settings.trajectories, Mapping):
        raise ValueError(f"training.validation.trajectories={dict(settings.trajectories)}: verl samples every "
                         "validation question alike (val_kwargs.n); give one count for the verl backend")
    decoding = ["actor_rollout_ref.rollout.val_kwargs.do_sample=false", "actor_rollout_ref.rollout.val_kwargs.n=1"]
    if settings.sampled:  # the rollout's temperature where validation names none (verl's val_kwargs has its own)
        decoding = ["actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                    f"actor_rollout_ref.rollout.val_kwargs.n={settings.trajectories}",
                    f"actor_rollout_ref.rollout.val_kwargs.temperature={_value(settings.sampling_temperature(temperature))}"]
    return [
        f"trainer.test_freq={settings.every or -1}",
        f"trainer.val_before_train={_value(settings.before_train)}",
        f"data.val_max_samples={settings.max_questions or -1}",
        "data.validation_shuffle=false",
        *decoding,
    ]


def native_design_overrides(trainer: Any) -> list[str]:
    """The native trainer's RL design (``trainer``: its :class:`~spader_pipeline.native.NativeTrainerConfig`)
    as verl overrides, so that a verl run trains the same design: the questions per step and the group
    size, the steps (an epoch of verl's loader at least a step: as many epochs as steps), the sampling
    temperature, the PPO epochs and mini-batches of whole groups, and the trajectory limits (turns,
    tokens per turn and in all, prompt length, observation length). What each trainer trains and at
    which learning rate is the trainer's own (the native trainer's top blocks against verl's model or
    LoRA adapters): not here."""
    prompts, mini_batches = int(trainer.prompts_per_step), int(trainer.ppo_mini_batches)  # whole groups: checked
    rollout = trainer.rollout
    steps = int(trainer.total_steps)
    return [
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.rollout.n={int(trainer.group_size)}",
        f"trainer.total_training_steps={steps}",
        f"trainer.total_epochs={steps}",
        f"actor_rollout_ref.rollout.temperature={_value(float(trainer.temperature))}",
        f"actor_rollout_ref.actor.ppo_epochs={int(trainer.ppo_epochs)}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts // mini_batches}",
        f"data.max_prompt_length={int(trainer.max_prompt_tokens)}",
        f"data.max_response_length={int(rollout.max_response_tokens)}",
        f"actor_rollout_ref.rollout.max_model_len={int(trainer.max_prompt_tokens) + int(rollout.max_response_tokens)}",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={int(rollout.max_turns)}",
        *([f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={int(rollout.max_observation_chars)}"]
          if rollout.max_observation_chars else []),
        f"++actor_rollout_ref.rollout.custom.max_turn_tokens={int(trainer.max_new_tokens)}",
    ]


def native_search_tool(trainer: Any) -> dict[str, Any]:
    """The search tool's settings (``training.verl.search_tool``) that give verl's agent loop the native
    rollout's search limits: passages per query, characters per passage and per observation."""
    rollout = trainer.rollout
    tool = {"topk": int(rollout.topk), "max_chars": rollout.max_chars, "max_observation_chars": rollout.max_observation_chars,
            "max_document_chars": rollout.max_document_chars, "max_queries_per_call": rollout.max_queries_per_call}
    return {k: v for k, v in tool.items() if v is not None}


def main_ppo_argv(params: Mapping[str, Any], config_dir: str | Path, python: str | None = None) -> list[str]:
    """Full argv: ``python -m verl.trainer.main_ppo --config-path <abs dir> --config-name method spader_method=<method> ...``."""
    return [
        python or sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(Path(config_dir).resolve()),
        "--config-name",
        overlay_name(params),
        *build_overrides(params),
    ]
