"""The table of backends that train a method: ``training.backend`` → the function that trains.

A backend registers itself with :func:`register_backend` (verl's habit at its extension points);
:mod:`.backends` registers the project's two (``native``, ``verl``) when the package is imported, so
the table is full before any settings are typed (:class:`~.settings.TrainingSettings` looks the
backend's name up here). The settings every backend reads are checked where they are typed, once;
the table holds no checks of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spader_pipeline.typed_config import SettingsError

__all__ = ["BACKENDS", "TrainFn", "TrainingBackend", "get_backend", "register_backend"]

#: ``train(settings, init_manifest=…, index_manifest=…, verl_train=…, verl_validation=…,
#: start_validation=…, template=…) -> (policy manifest, per-step history)``: one method's training
#: (``settings.method``, :class:`~.settings.TrainingSettings`) from the start model ``init_manifest``;
#: the history is empty where the backend logs it elsewhere (verl: the MLflow run)
TrainFn = Callable[..., tuple[dict[str, Any], list[dict[str, float]]]]


@dataclass(frozen=True)
class TrainingBackend:
    """One ``training.backend``."""

    name: str
    train: TrainFn
    """trains one method (:data:`TrainFn`)"""
    validates_start_model: bool
    """its runs take step 0 of their validation curve from the start model's shared validation
    (the ``validate_warm_start`` node); otherwise the backend validates step 0 itself"""


BACKENDS: dict[str, TrainingBackend] = {}


def register_backend(name: str, *, validates_start_model: bool) -> Callable[[TrainFn], TrainFn]:
    """Register the decorated function as the backend ``name`` (a different function under a name
    already taken is an error)."""

    def register(train: TrainFn) -> TrainFn:
        if name in BACKENDS and BACKENDS[name].train is not train:
            raise ValueError(f"training backend {name!r} is already registered")
        BACKENDS[name] = TrainingBackend(name, train, validates_start_model)
        return train

    return register


def get_backend(name: str) -> TrainingBackend:
    """The backend ``name``; an unknown name is an error listing the registered ones."""
    if name not in BACKENDS:
        raise SettingsError(f"training.backend={name!r}: use one of {sorted(BACKENDS)}")
    return BACKENDS[name]
