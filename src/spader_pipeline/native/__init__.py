"""Native single-process RL trainer (CPU or one GPU): config, batch layout, checkpoints, loop.

The package's names are imported on first use (PEP 562), so that importing one of its light modules
(``native.config``, ``native.checkpoint``, ``native.stages``) does not load the trainer and, with it,
transformers: a Kedro process that only hands a stage to a child process does not need them
(:mod:`spader_pipeline.child_process`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spader_pipeline.native.config import NativeTrainerConfig
    from spader_pipeline.native.trainer import TrainResult, train_native

__all__ = ["NativeTrainerConfig", "TrainResult", "train_native"]

_HOME = {"NativeTrainerConfig": "config", "TrainResult": "trainer", "train_native": "trainer"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
