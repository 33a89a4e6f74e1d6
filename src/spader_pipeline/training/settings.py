"""``training`` (``conf/base/parameters_training.yml``), typed once, with the method's block.

:meth:`TrainingSettings.from_mapping` applies the rules of :func:`spader_pipeline.typed_config.from_mapping`
to every block: an unknown key, a value of the wrong kind or a value a block rejects is a
:class:`~spader_pipeline.typed_config.SettingsError` naming the key's full path (``training.native.total_steps``)
and what it takes, raised where the settings are read (a Kedro node, or the check of
:class:`spader_pipeline.hooks.TrainingSettingsHooks` as a run starts), before any child process
starts. The backend's own blocks are checked by the backend (:mod:`spader_pipeline.training.backends`):
the native trainer's configuration, or verl's method settings.

:meth:`TrainingSettings.trainer_config` is the one construction of the native trainer's
configuration (:func:`spader_pipeline.native.config.trainer_config`) from these settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.rollout import RolloutConfig
from spader_pipeline.algorithms.validation import ValidationSettings
from spader_pipeline.launch.settings import VerlSettings, verl_settings
from spader_pipeline.native.config import NativeTrainerConfig, trainer_config
from spader_pipeline.retrieval.settings import RetrievalSettings, retrieval_settings
from spader_pipeline.typed_config import SettingsError, from_mapping, method_settings, typed_block

__all__ = ["TrainingSettings"]


@dataclass(frozen=True)
class TrainingSettings:
    """The ``training`` block (shared by every method), and one method's block when given."""

    backend: str = "native"
    """the trainer: a name of :data:`spader_pipeline.training.backends.BACKENDS` (``native``, ``verl``)"""
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
    reward: Mapping[str, Any] = field(default_factory=dict)
    """reward settings every method and both backends share, under the method's own"""
    validation: ValidationSettings = field(default_factory=ValidationSettings)
    """when and on what the policy is validated (both backends)"""
    native: Mapping[str, Any] = field(default_factory=dict)
    """native trainer settings every method shares (:class:`~spader_pipeline.native.NativeTrainerConfig` fields)"""
    verl: VerlSettings = field(default_factory=VerlSettings)
    """the verl launch (``training.verl``)"""
    run_label: str | None = None
    """a label in front of the method run's name (``compare``, ``positive_control``)"""
    method: Mapping[str, Any] | None = None
    """the method's block (``train_<method>.method``: ``method``, its ``reward`` and ``options``, and
    any trainer setting it sets for itself); ``None``: settings of no one method"""
    source: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """the ``training`` mapping as given (what the verl launcher composes its command from)"""

    @classmethod
    def from_mapping(cls, training: Mapping[str, Any] | TrainingSettings,
                     method: Mapping[str, Any] | None = None) -> TrainingSettings:
        """``training`` (and a method's block) typed and checked; the error names the key's path."""
        if isinstance(training, TrainingSettings):
            return training if method is None else dataclasses.replace(training, method=dict(method))
        values = dict(training or {})
        blocks = {
            "search": lambda v: retrieval_settings(v, where="training.search"),
            "rollout": lambda v: None if v is None else from_mapping(RolloutConfig, v, where="training.rollout",
                                                                     check_types=True),
            "validation": lambda v: from_mapping(ValidationSettings, v, where="training.validation", check_types=True),
            "verl": lambda v: verl_settings({"verl": v}),
        }
        for key, build in blocks.items():
            if key in values:
                values[key] = typed_block(f"training.{key}", lambda build=build, v=values[key]: build(v))
        return from_mapping(cls, values, where="training", check_types=True, exclude=("method", "source"),
                            method=None if method is None else dict(method), source=dict(training or {}))

    def __post_init__(self) -> None:
        from spader_pipeline.training.backends import get_backend

        backend = get_backend(self.backend)
        if self.method is not None and not self.method.get("method"):
            raise SettingsError(f"a method's block needs its `method` (one of the registered methods), got {dict(self.method)}")
        backend.check(self)

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
        return int({**self.native, **(self.method or {})}.get("seed", 0))

    def method_parameters(self) -> dict[str, Any]:
        """The method's block over the shared reward settings (``reward`` merged key by key): what
        defines the method, as its MLflow run logs it."""
        return method_settings({"reward": self.reward}, self.method or {})

    def run_dir(self) -> Path:
        """``<output_dir>/train_<method>``, where the method's run writes."""
        return Path(self.output_dir) / f"train_{self.method_name}"

    def template(self, prompt: Mapping[str, Any]) -> str:
        """The prompt template's text: ``prompt_template`` by name, else ``prompt.template``."""
        return resolve_template({**prompt, "template": self.prompt_template} if self.prompt_template else prompt)

    def trainer_config(self, **overrides: Any) -> NativeTrainerConfig:
        """The native trainer's configuration of the method: its block over ``reward`` and ``native``,
        ``overrides`` (the device, a time budget) last."""
        return trainer_config(self.native, self.method, reward=self.reward, method_where=self.method_path, **overrides)

    def start_config(self, **overrides: Any) -> NativeTrainerConfig:
        """``training.native`` alone, for the start model's validation (turn limits, device, precision)."""
        return trainer_config(self.native, **overrides)
