"""The backends that train a method, registered in the table of :mod:`.registry`:

* ``native``: the single-process trainer (:mod:`spader_pipeline.native`), in a child process with
  ``training.subprocess``; it validates from the start model's shared step 0;
* ``verl``: a ``verl.trainer.main_ppo`` launch (:mod:`spader_pipeline.launch.verl`), which validates
  on its own.

Each takes the typed settings (:class:`~spader_pipeline.training.settings.TrainingSettings`) and reads
nothing else: the native trainer its configuration (``settings.trainer``), verl its launch
(``settings.verl_launch()``), both built from the same method block.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

from spader_pipeline.child_process import in_child_process
from spader_pipeline.tracking.buffer import active_run_target
from spader_pipeline.training.registry import register_backend

if TYPE_CHECKING:
    from spader_pipeline.training.settings import TrainingSettings

__all__ = ["train_native", "train_verl"]


# ----------------------------------------------------------------------------------------------
# native
# ----------------------------------------------------------------------------------------------


@register_backend("native", validates_start_model=True)
def train_native(settings: TrainingSettings, *, init_manifest: Mapping[str, Any], index_manifest: Mapping[str, Any],
                 verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None,
                 start_validation: Mapping[str, Any] | None, template: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """The native trainer (:func:`spader_pipeline.native.stages.run_training`), in a child process
    with ``training.subprocess``; its metrics go to the active MLflow run."""
    from spader_pipeline.native.stages import run_training

    name, run_dir = settings.method_name, settings.run_dir()
    train = in_child_process(run_training, enabled=settings.subprocess, name=f"train_{name}")
    result = train(settings.trainer, search=settings.search, index_dir=index_manifest["index_dir"],
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


@register_backend("verl", validates_start_model=False)
def train_verl(settings: TrainingSettings, *, init_manifest: Mapping[str, Any], index_manifest: Mapping[str, Any],
               verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None,
               start_validation: Mapping[str, Any] | None, template: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """A verl launch (:func:`spader_pipeline.launch.verl.launch_verl_training`); its metrics reach the
    active MLflow run from verl's own files as the launch runs; the history is read back from them,
    under the native trainer's names (:func:`spader_pipeline.launch.metrics.training_history`)."""
    from spader_pipeline.launch.metrics import training_history
    from spader_pipeline.launch.verl import launch_verl_training

    run_dir = settings.run_dir()
    manifest = launch_verl_training(init_manifest, index_manifest, settings.verl_launch(), run_dir,
                                    train=verl_train, validation=verl_validation)
    return manifest, training_history(run_dir)
