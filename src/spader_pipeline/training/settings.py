"""``training`` (``conf/base/parameters_training.yml``), typed once, with the method's block.

:meth:`TrainingSettings.from_mapping` applies the rules of :func:`spader_pipeline.typed_config.from_mapping`
to every block: an unknown key, a value of the wrong kind or a value a block rejects is a
:class:`~spader_pipeline.typed_config.SettingsError` naming the key's full path (``training.native.total_steps``)
and what it takes, raised where the settings are read (a Kedro node, or the check of
:class:`spader_pipeline.hooks.TrainingSettingsHooks` as a run starts), before any child process
starts.

Past that edge nothing reads the mapping again: both backends read these settings. The native
trainer's configuration (:class:`~spader_pipeline.native.config.NativeTrainerConfig`) is built once,
as the settings are: the method's (its block over ``training.reward`` and ``training.native``), or,
for settings of no one method, ``training.native``'s alone (what validates the start model). A verl
launch reads the same method, reward settings and options from it (:meth:`TrainingSettings.verl_launch`).
``training.native`` and ``training.reward`` are layers: the method's block is laid over them before
the configuration is built, so they are kept as the keys they set, checked
(:class:`~spader_pipeline.typed_config.SettingsLayer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.algorithms.rewards import SpaderRewardConfig
from spader_pipeline.algorithms.validation import ValidationSettings, validation_subset
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.launch.settings import MethodLaunch, VerlSettings, verl_settings
from spader_pipeline.native.config import NativeTrainerConfig, trainer_config
from spader_pipeline.retrieval.settings import RetrievalSettings, retrieval_settings
from spader_pipeline.training.registry import get_backend
from spader_pipeline.typed_config import (
    SettingsError,
    SettingsLayer,
    from_mapping,
    method_settings,
    settings_layer,
    typed_block,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["TrainingSettings"]


#: what ``training.native`` may not set: the method's block decides them
METHOD_FIELDS = ("method", "reward", "options")


@dataclass(frozen=True)
class TrainingSettings:
    """The ``training`` block (shared by every method), and one method's block when given."""

    backend: str = "native"
    """the trainer: a name of :data:`spader_pipeline.training.registry.BACKENDS` (``native``, ``verl``)"""
    subprocess: bool = True
    """native: each run (and the shared step-0 validation) in a child process; false: in this process"""
    output_dir: str = "data/06_models"
    """runs go to ``<output_dir>/train_<method>/``"""
    prompt_template: str | None = None
    """a prompt template's name; ``None``: ``prompt.template``"""
    max_train_questions: int | None = None
    """train on a seeded subset of at most this many questions; ``None``: all"""
    search: RetrievalSettings = field(default_factory=RetrievalSettings)
    """what the rollouts search with (``training.search``)"""
    rollout: RolloutConfig | None = None
    """the trajectory limits other blocks refer to (``training.rollout``); ``None``: not set"""
    reward: SettingsLayer = field(default_factory=lambda: settings_layer(SpaderRewardConfig, {}, where="training.reward"))
    """reward settings every method and both backends share, under the method's own
    (:class:`~spader_pipeline.algorithms.SpaderRewardConfig` fields)"""
    validation: ValidationSettings = field(default_factory=ValidationSettings)
    """when and on what the policy is validated (both backends)"""
    native: SettingsLayer = field(default_factory=lambda: _native_layer({}))
    """native trainer settings every method shares (:class:`~spader_pipeline.native.NativeTrainerConfig`
    fields but the method's own)"""
    verl: VerlSettings = field(default_factory=VerlSettings)
    """the verl launch (``training.verl``)"""
    run_label: str | None = None
    """a label in front of the method run's name (``compare``, ``positive_control``)"""
    method: SettingsLayer | None = None
    """the method's block (``train_<method>.method``: ``method``, its ``reward`` and ``options``, and
    any trainer setting it sets for itself); ``None``: settings of no one method"""
    trainer: NativeTrainerConfig = field(init=False, repr=False, compare=False)
    """the trainer's configuration, built once with the settings: the method's, else ``training.native``'s"""

    @classmethod
    def from_mapping(cls, training: Mapping[str, Any] | TrainingSettings,
                     method: Mapping[str, Any] | None = None) -> TrainingSettings:
        """``training`` (and a method's block) typed and checked; the error names the key's path."""
        if isinstance(training, TrainingSettings):
            return training if method is None else training.with_method(method)
        values = dict(training or {})
        blocks = {
            "search": lambda v: retrieval_settings(v, where="training.search"),
            "rollout": lambda v: None if v is None else from_mapping(RolloutConfig, v, where="training.rollout",
                                                                     check_types=True),
            "validation": lambda v: from_mapping(ValidationSettings, v, where="training.validation", check_types=True),
            "verl": verl_settings,
            "native": _native_layer,
            "reward": lambda v: settings_layer(SpaderRewardConfig, v, where="training.reward",
                                               exclude=("enable_exploration",)),
        }
        for key, build in blocks.items():
            if key in values:
                values[key] = typed_block(f"training.{key}", lambda build=build, v=values[key]: build(v))
        return from_mapping(cls, values, where="training", check_types=True,
                            method=None if method is None else _method_layer(method))

    def __post_init__(self) -> None:
        get_backend(self.backend)  # an unknown backend: the error lists the registered ones
        if self.method is not None and not self.method.get("method"):
            raise SettingsError(f"a method's block needs its `method` (one of the registered methods), got {dict(self.method)}")
        object.__setattr__(self, "trainer", trainer_config(self.native, self.method, reward=self.reward,
                                                           method_where=self.method_path))

    def with_method(self, method: Mapping[str, Any]) -> TrainingSettings:
        """These settings with the method's block ``method`` (``train_<method>.method``)."""
        return dataclasses.replace(self, method=_method_layer(method))

    def with_changes(self, *, native: Mapping[str, Any] | None = None, validation: Mapping[str, Any] | None = None,
                     verl_overrides: tuple[str, ...] = (), **fields: Any) -> TrainingSettings:
        """These settings with ``native`` and ``validation`` keys set over their blocks, ``verl_overrides``
        appended to ``training.verl.overrides`` and top-level ``fields`` replaced; typed again, so a
        change is checked as the YAML is (a compare cell's seed and folder, the positive control's
        validation on every question)."""
        changed = dict(fields)
        if native:
            changed["native"] = _native_layer({**self.native, **native})
        if validation:
            changed["validation"] = dataclasses.replace(self.validation, **validation)
        if verl_overrides:
            changed["verl"] = dataclasses.replace(self.verl, overrides=(*self.verl.overrides, *verl_overrides))
        return dataclasses.replace(self, **changed)

    # ---- what the settings say ---------------------------------------------------------------

    @property
    def method_name(self) -> str:
        if self.method is None:
            raise ValueError("these training settings have no method block")
        return str(self.method["method"])

    @property
    def method_path(self) -> str:
        """Where the method's block comes from, for messages (``train_<method>.method``)."""
        return f"train_{self.method['method']}.method" if self.method else "the method block"

    @property
    def seed(self) -> int:
        """The RL seed: the method's, else ``training.native.seed``, else 0 (both backends)."""
        return self.trainer.seed

    def method_parameters(self) -> dict[str, Any]:
        """The method's block over the shared reward settings (``reward`` merged key by key): what
        defines the method, as its MLflow run logs it."""
        return method_settings({"reward": dict(self.reward)}, dict(self.method or {}))

    def run_dir(self) -> Path:
        """``<output_dir>/train_<method>``, where the method's run writes."""
        return Path(self.output_dir) / f"train_{self.method_name}"

    def template(self, prompt: Mapping[str, Any]) -> str:
        """The prompt template's text: ``prompt_template`` by name, else ``prompt.template``."""
        return resolve_template({**prompt, "template": self.prompt_template} if self.prompt_template else prompt)

    def trainer_config(self, **overrides: Any) -> NativeTrainerConfig:
        """The native trainer's configuration of the method (:attr:`trainer`), ``overrides`` (the device,
        a time budget) set over it."""
        return dataclasses.replace(self.trainer, **overrides) if overrides else self.trainer

    def start_config(self, **overrides: Any) -> NativeTrainerConfig:
        """``training.native`` alone, for the start model's validation (turn limits, device, precision)."""
        if self.method is None:
            return self.trainer_config(**overrides)
        return trainer_config(self.native, reward=self.reward, **overrides)

    def start_validation_samples(self, validation: pd.DataFrame | None) -> list[dict[str, Any]]:
        """The validation questions the start model is scored on once, step 0 of every method's curve
        (the Kedro chain's ``validate_warm_start`` node and the portable run); none when the schedule
        has no step 0 or the backend validates step 0 itself (verl)."""
        if validation is None or not self.validation.before_train or not get_backend(self.backend).validates_start_model:
            return []
        return validation_subset(samples_from_verl(validation), self.validation.max_questions)

    def verl_launch(self) -> MethodLaunch:
        """What a verl launch of the method reads: its method, reward settings and options as the
        trainer's configuration holds them, the validation schedule and ``training.verl``."""
        return MethodLaunch(method=self.method_name, reward=self.trainer.reward, options=self.trainer.options,
                            validation=self.validation, verl=self.verl)


def _method_layer(method: Mapping[str, Any]) -> SettingsLayer:
    where = f"train_{method.get('method')}.method" if method.get("method") else "the method block"
    return settings_layer(NativeTrainerConfig, method, where=where, nested={"rollout": RolloutConfig})


def _native_layer(values: Mapping[str, Any] | None) -> SettingsLayer:
    return settings_layer(NativeTrainerConfig, values, where="training.native", exclude=METHOD_FIELDS,
                          nested={"rollout": RolloutConfig})
