"""Nodes of the training stage. Thin: they type the settings (:class:`~spader_pipeline.training.TrainingSettings`),
run the stages of :mod:`spader_pipeline.native.stages` (in a child process with ``subprocess``) or
the backend ``training.backend`` names (:mod:`spader_pipeline.training.backends`), and record the
runs in MLflow (:mod:`spader_pipeline.tracking`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.child_process import in_child_process, runs_child_processes
from spader_pipeline.native.checkpoint import SettingsChanged, rollout_decoding_path
from spader_pipeline.native.stages import run_warm_start, validate_start_model
from spader_pipeline.native.warm_start import WarmStartSettings
from spader_pipeline.tracking.buffer import active_run_target
from spader_pipeline.training import TrainingSettings, get_backend

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def _template(prompt: Mapping[str, Any], name: str | None = None) -> str:
    if name:
        return resolve_template({**prompt, "template": name})
    return resolve_template(prompt)


# ----------------------------------------------------------------------------------------------
# Warm start
# ----------------------------------------------------------------------------------------------


@runs_child_processes
def warm_start(
    base_model_manifest: Mapping[str, Any],
    verl_train: pd.DataFrame,
    verl_validation: pd.DataFrame,
    index_manifest: Mapping[str, Any],
    params: Mapping[str, Any],
    prompt: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, float]]:
    """Supervised warm start of the base model (:func:`spader_pipeline.native.warm_start.warm_start`);
    its manifest and summary metrics. ``params`` is typed first (:class:`~spader_pipeline.native.warm_start.
    WarmStartSettings`). ``enabled: false`` passes the base model through unchanged. With ``subprocess``
    (default) it runs in a child process, which returns its memory when it ends."""
    settings = WarmStartSettings.from_mapping(params)
    if not settings.enabled:
        logger.info("warm start disabled; RL starts from the base model")
        return {**base_model_manifest, "warm_start": False}, {}
    run = in_child_process(run_warm_start, enabled=settings.subprocess, name="warm_start")
    return run(base_model_manifest["path"], verl_train, verl_validation, index_manifest["index_dir"], settings,
               _template(prompt, settings.prompt_template), active_run_target())


# ----------------------------------------------------------------------------------------------
# RL
# ----------------------------------------------------------------------------------------------


def method_run_identity(init_manifest: Mapping[str, Any], settings: TrainingSettings) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Name, tags and parameters of a method's MLflow run (``settings``: with the method's block).

    The parameters are what defines the method — its ``train_<method>.method`` block over the shared
    reward settings — under namespace-free keys (``method``, ``reward.alpha``, ``options.gamma``…),
    so MLflow's compare view of two methods' runs shows exactly their differences; and, for the native
    trainer, the path this machine decodes the rollouts with (``decode.*``:
    :func:`~spader_pipeline.native.checkpoint.rollout_decoding_path`; verl's rollout server is verl's).
    """
    name, seed = settings.method_name, settings.seed
    base = init_manifest.get("base") or init_manifest["path"]
    tags = {"method": name, "backend": settings.backend, "base_model": Path(str(base)).name, "seed": seed,
            "init_model": init_manifest["path"]}
    params = {"backend": settings.backend, "seed": seed, **settings.method_parameters()}
    if settings.backend == "native":
        params.update(rollout_decoding_path(settings.trainer))
    label = settings.run_label  # e.g. "compare": a compare cell's run, told apart at a glance
    if label:
        tags["chain_kind"] = label
    return f"{label + ' ' if label else ''}{name} seed{seed}", tags, params


@runs_child_processes
def train_policy(
    init_manifest: Mapping[str, Any],
    verl_train: pd.DataFrame,
    index_manifest: Mapping[str, Any],
    method: Mapping[str, Any],
    training: Mapping[str, Any],
    prompt: Mapping[str, Any],
    verl_validation: pd.DataFrame | None = None,
    warm_start_validation: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, float]], dict[str, float]]:
    """Train one method from ``init_manifest``; return the policy manifest, the per-step history
    and final summary metrics. ``training`` and the method's block are typed first
    (:class:`~spader_pipeline.training.TrainingSettings`: a bad key or value stops here, before any
    child process); ``training.backend`` names the backend that trains
    (:mod:`spader_pipeline.training.backends`).

    With ``verl_validation`` the policy is validated on its fixed subset on ``training.validation``'s
    schedule (:mod:`spader_pipeline.algorithms.validation`): ``val/<source>/…`` per step, step 0 first
    (``warm_start_validation``'s, computed once for every method, when it scored the same start model).

    The training is one MLflow run of its own (:func:`spader_pipeline.tracking.method_run`) with the
    same metric keys for every method; VERL joins it through ``MLFLOW_RUN_ID``. The manifest
    records the run id (and the checkpoint's MLflow model id), which evaluation links back to.
    """
    settings = TrainingSettings.from_mapping(training, method)
    backend = get_backend(settings.backend)
    run_name, tags, params = method_run_identity(init_manifest, settings)
    with tracking.method_run(run_name, tags, params) as run_id:
        try:
            manifest, history = backend.train(settings, init_manifest=init_manifest, index_manifest=index_manifest,
                                              verl_train=verl_train, verl_validation=verl_validation,
                                              start_validation=warm_start_validation, template=settings.template(prompt))
        except SettingsChanged as changed:  # the trainer's error, with the ways on in Kedro's terms
            raise changed.with_ways_on(_ways_on(settings.run_dir())) from None
        manifest["mlflow_run_id"] = run_id
        if manifest.get("path"):
            manifest["mlflow_model_id"] = tracking.register_checkpoint(manifest["path"], name=settings.method_name,
                                                                       params=params)
        summary = _summary(history) if history else {}
        tracking.log_metrics(summary)
    return manifest, history, summary


def _ways_on(run_dir: Path) -> tuple[str, str]:
    """How to go on with new settings when ``run_dir``'s checkpoints were written with others."""
    return (f"train into a new folder: set training.output_dir elsewhere (runs go to <output_dir>/{run_dir.name}; "
            "compare cells: compare.output_dir)",
            "start afresh here: `--params training.native.resume=false` (the checkpoints then move to "
            f"{run_dir}/checkpoints.superseded-<time>/ with the run's config.json and metrics.jsonl)")


@runs_child_processes
def validate_warm_start(
    warm_start_manifest: Mapping[str, Any],
    verl_validation: pd.DataFrame,
    index_manifest: Mapping[str, Any],
    training: Mapping[str, Any],
    prompt: Mapping[str, Any],
) -> dict[str, Any]:
    """Step 0 of every method's validation curve, computed once: the start model, greedy, on the
    validation subset with the native trainer's turn limits (``{"identity", "metrics"}``; empty when
    the schedule has no step 0 or the backend validates step 0 itself, as verl's loop does). It runs
    in a child process with ``training.subprocess``, as training does."""
    settings = TrainingSettings.from_mapping(training)
    samples = settings.start_validation_samples(verl_validation)
    if not samples:
        return {}
    validate = in_child_process(validate_start_model, enabled=settings.subprocess, name="validate_warm_start")
    metrics, identity = validate(warm_start_manifest["path"], samples, config=settings.start_config(),
                                 search=settings.search, index_dir=index_manifest["index_dir"],
                                 template=settings.template(prompt), validation=settings.validation)
    logger.info("warm start validation (step 0 of every method): %s",
                ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    return {"identity": identity, "metrics": metrics}


def _summary(history: list[dict[str, float]], window: int = 10) -> dict[str, float]:
    """Means of the last ``window`` steps (the run's end state) plus the step count."""
    if not history:
        return {"steps": 0.0}
    tail = history[-window:]
    keys = [k for k in tail[-1] if k != "step"]
    out = {f"last{window}/{k}": float(np.mean([h[k] for h in tail if k in h])) for k in keys}
    out["steps"] = float(history[-1]["step"])
    out["seconds"] = float(sum(h.get("perf/step_seconds", 0.0) for h in history))
    return out
