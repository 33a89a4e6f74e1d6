"""The backends that train a method: a table from ``training.backend`` to the function that trains.

Each entry (:class:`TrainingBackend`) holds the function that trains one method from a start model
and the check of the settings only it reads, run when the settings are typed
(:class:`~spader_pipeline.training.settings.TrainingSettings`), before anything starts. A new backend
registers itself with :func:`register_backend` (verl's registries at its extension points):

* ``native``: the single-process trainer (:mod:`spader_pipeline.native`), in a child process with
  ``training.subprocess``; it validates from the start model's shared step 0;
* ``verl``: a ``verl.trainer.main_ppo`` launch (:mod:`spader_pipeline.launch.verl`), which validates
  on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from spader_pipeline.child_process import in_child_process
from spader_pipeline.native.config import method_blocks
from spader_pipeline.tracking.buffer import active_run_target
from spader_pipeline.typed_config import SettingsError

if TYPE_CHECKING:
    from spader_pipeline.training.settings import TrainingSettings

__all__ = ["BACKENDS", "TrainFn", "TrainingBackend", "get_backend", "register_backend"]

#: ``train(settings, init_manifest=…, index_manifest=…, verl_train=…, verl_validation=…,
#: start_validation=…, template=…) -> (policy manifest, per-step history)``: one method's training
#: (``settings.method``) from the start model ``init_manifest``; the history is empty where the
#: backend logs it elsewhere (verl: the MLflow run)
TrainFn = Callable[..., tuple[dict[str, Any], list[dict[str, float]]]]


@dataclass(frozen=True)
class TrainingBackend:
    """One ``training.backend``."""

    name: str
    train: TrainFn
    """trains one method (:data:`TrainFn`)"""
    check: Callable[[TrainingSettings], None]
    """raises :class:`~spader_pipeline.typed_config.SettingsError` for settings this backend cannot run"""
    validates_start_model: bool
    """its runs take step 0 of their validation curve from the start model's shared validation
    (the ``validate_warm_start`` node); otherwise the backend validates step 0 itself"""


BACKENDS: dict[str, TrainingBackend] = {}


def register_backend(name: str, *, check: Callable[[TrainingSettings], None],
                     validates_start_model: bool) -> Callable[[TrainFn], TrainFn]:
    """Register the decorated function as the backend ``name`` (a different function under a name
    already taken is an error)."""

    def register(train: TrainFn) -> TrainFn:
        if name in BACKENDS and BACKENDS[name].train is not train:
            raise ValueError(f"training backend {name!r} is already registered")
        BACKENDS[name] = TrainingBackend(name, train, check, validates_start_model)
        return train

    return register


def get_backend(name: str) -> TrainingBackend:
    """The backend ``name``; an unknown name is an error listing the registered ones."""
    if name not in BACKENDS:
        raise SettingsError(f"training.backend={name!r}: use one of {sorted(BACKENDS)}")
    return BACKENDS[name]


# ----------------------------------------------------------------------------------------------
# native
# ----------------------------------------------------------------------------------------------


def _check_native(settings: TrainingSettings) -> None:
    """The trainer's configuration builds: the start model's, and the method's when there is one."""
    settings.start_config()
    if settings.method is not None:
        settings.trainer_config()


@register_backend("native", check=_check_native, validates_start_model=True)
def train_native(settings: TrainingSettings, *, init_manifest: Mapping[str, Any], index_manifest: Mapping[str, Any],
                 verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None,
                 start_validation: Mapping[str, Any] | None, template: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """The native trainer (:func:`spader_pipeline.native.stages.run_training`), in a child process
    with ``training.subprocess``; its metrics go to the active MLflow run."""
    from spader_pipeline.native.stages import run_training

    name, run_dir = settings.method_name, settings.run_dir()
    train = in_child_process(run_training, enabled=settings.subprocess, name=f"train_{name}")
    result = train(settings.trainer_config(), search=settings.search, index_dir=index_manifest["index_dir"],
                   run_target=active_run_target(), model_path=init_manifest["path"], verl_train=verl_train,
                   verl_validation=verl_validation, run_dir=run_dir, template=template,
                   max_train_questions=settings.max_train_questions, validation_settings=settings.validation,
                   start_validation=start_validation)
    manifest = {"path": str(result.final_model_dir.resolve()), "method": name, "backend": "native",
                "steps": result.steps, "run_dir": str(run_dir.resolve()), "init": init_manifest["path"],
                "resumed_from": result.resumed_from}
    return manifest, result.history


# ----------------------------------------------------------------------------------------------
# verl
# ----------------------------------------------------------------------------------------------


def _check_verl(settings: TrainingSettings) -> None:
    """The method's reward settings and options are the registry's (verl reads them through it)."""
    if settings.method is None:
        return
    block = settings.method_parameters()
    method_blocks(settings.method_name, block.get("reward"), block.get("options"), method_where=settings.method_path)


@register_backend("verl", check=_check_verl, validates_start_model=False)
def train_verl(settings: TrainingSettings, *, init_manifest: Mapping[str, Any], index_manifest: Mapping[str, Any],
               verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None,
               start_validation: Mapping[str, Any] | None, template: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """A verl launch (:func:`spader_pipeline.launch.verl.launch_verl_training`); its metrics reach the
    active MLflow run from verl's own files as the launch runs; the history is read back from them,
    under the native trainer's names (:func:`spader_pipeline.launch.metrics.training_history`)."""
    from spader_pipeline.launch.metrics import training_history
    from spader_pipeline.launch.verl import launch_verl_training

    run_dir = settings.run_dir()
    manifest = launch_verl_training(init_manifest, index_manifest, dict(settings.method or {}), settings.source,
                                    run_dir, train=verl_train, validation=verl_validation)
    return manifest, training_history(run_dir)
