"""The native stages of the chain, the same functions for the Kedro nodes and the portable run.

A *stage* takes an open search backend and typed settings and does one thing:

* :func:`warm_start` (the function of :mod:`spader_pipeline.native.warm_start`): supervised fine-tuning
  of the base model on demonstrations;
* :func:`validate_start`: the start model, greedy, on the validation subset (step 0 of every method's
  curve, computed once);
* :func:`train`: one method's RL run from VERL parquet rows
  (:func:`spader_pipeline.native.trainer.train_native`).

The Kedro nodes run each in a child process (:func:`spader_pipeline.child_process.in_child_process`)
through an *entry* below (:func:`run_warm_start`, :func:`validate_start_model`, :func:`run_training`):
a module-level function that opens the search backend from its settings over the index, and sends
what the stage logs to an MLflow run given by id (``run_target``: id and tracking URI, ``(None, None)``
for none) through a buffered writer, so no step waits on, or fails with, the tracking server (a child
process does not inherit its parent's active run). The portable run opens one search backend and
calls the stages themselves (:mod:`spader_pipeline.portable.run`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.algorithms.validation import ValidationSettings
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.native.warm_start import WarmStartSettings
from spader_pipeline.retrieval.settings import RetrievalSettings, search_backend
from spader_pipeline.tracking.buffer import run_writer

if TYPE_CHECKING:
    from spader_pipeline.native.trainer import TrainResult

RunTarget = tuple[str | None, str | None]


# ----------------------------------------------------------------------------------------------
# Stages: an open search backend, typed settings
# ----------------------------------------------------------------------------------------------


def warm_start(model_path: str, verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None, search: Any,
               settings: WarmStartSettings, template: str,
               on_log: Callable[[int, Mapping[str, float]], None] | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """:func:`spader_pipeline.native.warm_start.warm_start`: ``(manifest, metrics)`` of the model
    fine-tuned from ``model_path`` (the ``warm_start`` settings)."""
    from spader_pipeline.native.warm_start import warm_start as fine_tune

    return fine_tune(model_path, verl_train, verl_validation, search, settings, template, on_log=on_log)


def validate_start(model_path: str, samples: Sequence[Mapping[str, Any]], search: Any, config: NativeTrainerConfig,
                   template: str, validation: ValidationSettings | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """``(metrics, identity)`` of the model at ``model_path`` on the validation ``samples`` with the
    trainer's turn limits, device, precision and temperature (``config``), decoded as ``validation``
    (``training.validation``: batches, sampled trajectories) says."""
    from spader_pipeline.native.validation import validate_model_at

    return validate_model_at(model_path, samples, search, config, template, validation=validation or ValidationSettings())


def train(config: NativeTrainerConfig, *, model_path: str, verl_train: pd.DataFrame,
          verl_validation: pd.DataFrame | None, search: Any, run_dir: Path, template: str,
          max_train_questions: int | None = None, validation_settings: ValidationSettings | None = None,
          start_validation: Mapping[str, Any] | None = None,
          log_metrics: Callable[[Mapping[str, float], int], None] | None = None,
          log_artifact: Callable[[Path], None] | None = None) -> TrainResult:
    """One native training run (:func:`spader_pipeline.native.train_native`) on VERL parquet rows.

    ``verl_train``: at most ``max_train_questions`` of its questions, drawn with the run's seed;
    ``verl_validation``: the questions validated on ``validation_settings``' schedule (step 0 from
    ``start_validation`` when it scored the same start model).
    """
    from spader_pipeline.native.trainer import train_native

    samples = samples_from_verl(verl_train, max_train_questions, config.seed)
    validation = samples_from_verl(verl_validation) if verl_validation is not None and len(verl_validation) else []
    return train_native(config, model_path=model_path, samples=samples, search=search, run_dir=run_dir,
                        prompt_template=template, log_metrics=log_metrics, log_artifact=log_artifact,
                        validation=validation, validation_settings=validation_settings,
                        start_validation=start_validation)


# ----------------------------------------------------------------------------------------------
# Entries of a child process: open the search backend and the MLflow writer, run the stage
# ----------------------------------------------------------------------------------------------


def run_warm_start(model_path: str, verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None, index_dir: str,
                   settings: WarmStartSettings, template: str,
                   run_target: RunTarget = (None, None)) -> tuple[dict[str, Any], dict[str, float]]:
    """:func:`warm_start` searching ``settings.search`` over the index at ``index_dir``, its curve logged
    to the MLflow run ``run_target`` as ``warm_start/train/…``."""
    with (search_backend(settings.search, index_dir, where="warm_start.search") as search,
          run_writer(*run_target) as writer):
        on_log = (lambda step, m: writer.log_metrics(tracking.numeric_items(m, "warm_start/train"), step)) if writer else None
        return warm_start(model_path, verl_train, verl_validation, search, settings, template, on_log=on_log)


def validate_start_model(model_path: str, samples: Sequence[Mapping[str, Any]], *, config: NativeTrainerConfig,
                         search: RetrievalSettings, index_dir: str, template: str,
                         validation: ValidationSettings | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """:func:`validate_start` searching ``search`` (``training.search``) over the index at ``index_dir``."""
    with search_backend(search, index_dir, where="training.search") as backend:
        return validate_start(model_path, samples, backend, config, template, validation)


def run_training(config: NativeTrainerConfig, *, search: RetrievalSettings, index_dir: str,
                 run_target: RunTarget = (None, None), **stage: Any) -> TrainResult:
    """:func:`train` (``stage``: its other arguments) searching ``search`` (``training.search``) over the
    index at ``index_dir``; step metrics (comparable ones first) and sample files go to the MLflow run
    ``run_target``."""
    with (search_backend(search, index_dir, where="training.search") as backend, run_writer(*run_target) as writer):
        return train(
            config, search=backend,
            log_metrics=(lambda m, step: writer.log_metrics(tracking.comparable_first(m), step)) if writer else None,
            log_artifact=(lambda p: writer.log_artifact(p, artifact_path="samples")) if writer else None,
            **stage,
        )
