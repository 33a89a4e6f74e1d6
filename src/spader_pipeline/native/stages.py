"""The native stages from plain settings, each a module-level function that a child process can run
(:func:`spader_pipeline.child_process.in_child_process`): the warm start, the start model's
validation (step 0 of every method's curve) and a training run. What a stage logs goes to an MLflow
run given by id (``run_target``: id and tracking URI, ``(None, None)`` for none) through a buffered
writer, so no step waits on, or fails with, the tracking server; a child process does not inherit
its parent's active run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.algorithms.validation import ValidationSettings
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.retrieval.settings import search_backend
from spader_pipeline.tracking.buffer import run_writer

if TYPE_CHECKING:
    from spader_pipeline.native.trainer import TrainResult

RunTarget = tuple[str | None, str | None]


def run_warm_start(model_path: str, verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None, index_dir: str,
                   params: Mapping[str, Any], template: str,
                   run_target: RunTarget = (None, None)) -> tuple[dict[str, Any], dict[str, float]]:
    """:func:`spader_pipeline.native.warm_start.warm_start`, its curve logged to the MLflow run
    ``run_target`` as ``warm_start/train/…``."""
    from spader_pipeline.native.warm_start import warm_start

    with run_writer(*run_target) as writer:
        on_log = (lambda step, m: writer.log_metrics(tracking.numeric_items(m, "warm_start/train"), step)) if writer else None
        return warm_start(model_path, verl_train, verl_validation, index_dir, params, template, on_log=on_log)


def validate_start_model(model_path: str, samples: Sequence[Mapping[str, Any]], *, native: Mapping[str, Any] | None,
                         search: Mapping[str, Any] | None, index_dir: str,
                         template: str, batch_size: int | Mapping[str, int] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """``(metrics, identity)`` of the model at ``model_path``, greedy on the validation ``samples``
    with the trainer's turn limits and precision (``native``: the ``training.native`` settings;
    ``search``: ``training.search`` over the index at ``index_dir``), ``batch_size`` questions at a
    time (``training.validation.batch_size``)."""
    from spader_pipeline.native.validation import validate_model_at

    config = NativeTrainerConfig.from_mapping(dict(native or {}))
    with search_backend(search, index_dir, where="training.search") as backend:
        return validate_model_at(model_path, samples, backend, config, template, batch_size=batch_size)


def run_training(native: Mapping[str, Any], *, model_path: str, verl_train: pd.DataFrame,
                 verl_validation: pd.DataFrame | None, search: Mapping[str, Any] | None, index_dir: str,
                 run_dir: Path, template: str, max_train_questions: int | None = None,
                 validation_settings: ValidationSettings | None = None,
                 start_validation: Mapping[str, Any] | None = None,
                 run_target: RunTarget = (None, None)) -> TrainResult:
    """One native training run (:func:`spader_pipeline.native.train_native`) from plain settings.

    ``native``: the method's trainer settings (the shared ``training.native`` under its method
    block); ``verl_train`` / ``verl_validation``: the VERL parquet rows (at most
    ``max_train_questions`` training questions, drawn with the run's seed); ``search``: the search
    settings over the index at ``index_dir``. Step metrics (comparable ones first) and sample files
    go to the MLflow run ``run_target``.
    """
    from spader_pipeline.native.trainer import train_native

    config = NativeTrainerConfig.from_mapping(native)
    samples = samples_from_verl(verl_train, max_train_questions, config.seed)
    validation = samples_from_verl(verl_validation) if verl_validation is not None and len(verl_validation) else []
    with (search_backend(search, index_dir, where="training.search") as backend, run_writer(*run_target) as writer):
        return train_native(
            config,
            model_path=model_path,
            samples=samples,
            search=backend,
            run_dir=run_dir,
            prompt_template=template,
            log_metrics=(lambda m, step: writer.log_metrics(tracking.comparable_first(m), step)) if writer else None,
            log_artifact=(lambda p: writer.log_artifact(p, artifact_path="samples")) if writer else None,
            validation=validation,
            validation_settings=validation_settings,
            start_validation=start_validation,
        )
