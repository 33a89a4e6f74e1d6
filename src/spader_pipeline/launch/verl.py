"""Launch VERL training (``python -m verl.trainer.main_ppo``) from a Kedro node.

What the launch does, in order:

1. starts the retrieval service on the index (``spader-retrieval serve``) unless a URL is given
   (``training.verl.retrieval``, the project's one
   :class:`~spader_pipeline.retrieval.settings.RetrievalSettings`), and writes a run-specific copy of
   the search-tool config pointing at it. verl runs its agent-loop workers on every Ray node, so with
   ``nnodes > 1`` the URL they get must not be loopback: bind the started service with
   ``retrieval.bind_host`` (e.g. ``0.0.0.0``) and give the address the other nodes reach it at in
   ``retrieval.advertised_host``, or pass an external ``retrieval.url``;
2. writes the node's ``verl_train``/``verl_validation`` datasets to ``<run_dir>/data/`` (unless
   ``training.verl.train_files``/``val_files`` name files), so verl reads the catalog's data wherever
   ``data_root`` puts it;
3. composes the command with :func:`~spader_pipeline.launch.overrides.main_ppo_argv` (``conf/base/verl/method.yaml``
   with ``spader_method=<method>``, whose settings come from the method registry, plus the
   overrides generated from Kedro parameters);
4. sets the environment: ``VERL_USE_EXTERNAL_MODULES=spader_pipeline.verl_plugin`` (our estimators,
   reward manager and agent loop register in every Ray process), ``MLFLOW_TRACKING_URI`` and
   ``MLFLOW_RUN_ID`` of the Kedro run (VERL's MLflow tracker joins it), ``RAY_ADDRESS`` for an
   existing cluster. The same variables are forwarded to every Ray worker through
   ``ray_kwargs.ray_init.runtime_env.env_vars`` (workers of a pre-started cluster do not inherit
   the launching shell's environment);
5. streams VERL's output to the log and to ``<run_dir>/verl.log``; a non-zero exit raises
   :class:`VerlLaunchError` carrying the last lines, so the node (and the Kedro run) fails with them.

This module is the order of those steps; each has its own module: the settings (:mod:`.settings`),
the command line and environment (:mod:`.command`), the data files (:mod:`.data_files`), the process
runner (:mod:`.process`) and the metrics follower (:mod:`.metrics`). Everything the launch reads comes
typed (:class:`~.settings.MethodLaunch`). Only :func:`launch_verl_training` needs a GPU;
:func:`~.command.build_launch` is pure and tested on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spader_pipeline.launch.command import build_launch, check_worker_url
from spader_pipeline.launch.metrics import following
from spader_pipeline.launch.process import VerlLaunchError, run_streaming
from spader_pipeline.launch.settings import MethodLaunch, VerlSettings
from spader_pipeline.retrieval.settings import service_url
from spader_pipeline.tracking.buffer import active_run_target

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

__all__ = ["final_checkpoint", "launch_verl_training"]


@contextlib.contextmanager
def _retrieval(verl: VerlSettings, index_manifest: Mapping[str, Any]) -> Iterator[str]:
    """The URL the agent-loop workers use: ``retrieval.url``, or a service started here for the run
    (its URL checked before it starts)."""
    with service_url(verl.retrieval, index_manifest.get("index_dir"),
                     check=lambda url: check_worker_url(url, verl.nnodes)) as url:
        yield url


def launch_verl_training(
    init_manifest: Mapping[str, Any],
    index_manifest: Mapping[str, Any],
    launch: MethodLaunch,
    run_dir: str | Path,
    *,
    train: pd.DataFrame | None = None,
    validation: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """Run one VERL training of ``launch.method`` to completion (GPU); return a manifest of its checkpoints.

    ``train``/``validation`` are the node's ``verl_train``/``verl_validation`` datasets, what verl
    reads unless ``training.verl`` names files (:func:`~.data_files.data_files`). VERL logs into the
    active MLflow run (the Kedro run) when there is one.
    """
    verl = launch.verl
    run_id, tracking_uri = active_run_target()
    with _retrieval(verl, index_manifest) as url:
        command = build_launch(init_manifest, launch, run_dir, retrieval_url=url, tracking_uri=tracking_uri,
                               run_id=run_id, train=train, validation=validation)
        logger.info("launching VERL: %s", " ".join(command.argv))
        with following(command.extra["metrics_files"]):
            run_streaming(command.argv, command.env, command.log_path, tail_lines=verl.log_tail_lines,
                          timeout=verl.timeout)
    checkpoint = final_checkpoint(run_dir)
    return {"backend": "verl", "method": launch.method, "checkpoint": str(checkpoint.resolve()),
            "actor_dir": str((checkpoint / "actor").resolve()), "path": None,
            "run_dir": str(Path(run_dir).resolve()), "argv": command.argv, "python": sys.executable}


def final_checkpoint(run_dir: str | Path) -> Path:
    """The newest ``<run_dir>/checkpoints/global_step_<N>`` verl wrote; an error when there is none."""
    checkpoints = Path(run_dir) / "checkpoints"
    steps = sorted(checkpoints.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[-1]))
    if not steps:
        raise VerlLaunchError(f"VERL finished but wrote no checkpoint under {checkpoints}")
    return steps[-1]
