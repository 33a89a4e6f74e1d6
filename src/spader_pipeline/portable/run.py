"""Run a bundle (:mod:`.bundle`) end to end in one process: warm start → RL per method → held-out scores.

This module reads the bundle and orders the stages; the stages are the Kedro chain's, called
directly with one open in-process index: the warm start (:func:`spader_pipeline.native.stages.warm_start`),
the shared step-0 validation (:func:`~spader_pipeline.native.stages.validate_start`), then per method
from the same warm start the native trainer (:func:`~spader_pipeline.native.stages.train`) and the
held-out evaluation (:mod:`spader_pipeline.portable.methods`). The summary, its table and the curves
are :mod:`spader_pipeline.reporting.portable`'s. Output folder::

    summary.json / summary.md   held-out recall and F1 per model with a 95% question-bootstrap
                                interval, each method's paired difference from the warm start (and
                                the questions it got better or worse on) and from the method before
                                it, the held-out mechanism, the stage times, the device, the package
                                versions and the decoding path; summary.md also one row per method and
                                RL step (the mechanism metrics and where the step's time went)
    heldout_records.jsonl       one evaluation record per model × held-out question
    curves.json / curves.png    validation recall per step per method, the warm start's as a line
    warm_start/, train_<m>/     the models, checkpoints and per-step metrics (metrics.jsonl)

One seed: the intervals are over questions only, and say nothing of the seed-to-seed spread.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from spader_pipeline.data.schema import frame_records
from spader_pipeline.modeling.device import resolve_device
from spader_pipeline.native import stages
from spader_pipeline.native.warm_start import WarmStartSettings
from spader_pipeline.portable.bundle import base_model_dir, read_settings, with_overrides
from spader_pipeline.portable.methods import (
    MethodStage,
    evaluate_heldout,
    free_device,
    run_method,
    run_side_by_side,
    stage_clock,
)
from spader_pipeline.reporting.portable import environment, summarise, write_outputs
from spader_pipeline.retrieval.settings import search_backend
from spader_pipeline.training import TrainingSettings

logger = logging.getLogger(__name__)

REFERENCE = "warm_start"


def run_bundle(bundle: str | Path, out: str | Path, *, device: str = "auto", methods: Sequence[str] | None = None,
               rl_seconds: float | None = None, overrides: Mapping[str, Any] | None = None,
               max_heldout: int | None = None, parallel_methods: bool = False) -> dict[str, Any]:
    """Run the bundle at ``bundle`` into ``out``; returns the summary (also ``out/summary.json``).

    Args:
        device: where the models run (``auto``: CUDA when present), for every stage.
        methods: the methods to train (default: the bundle's, in its order).
        rl_seconds: a wall-clock budget per method's RL run, over the settings' ``max_seconds``.
        overrides: ``{"dotted.key": value}`` laid over the bundle's settings (e.g.
            ``{"training.native.total_steps": 2}``), recorded in the summary.
        max_heldout: score only the first N held-out questions (smoke runs; ``None``: all).
        parallel_methods: train and evaluate the methods side by side, one child process each, on the
            same device (after the shared warm start). A small model's rollout leaves a GPU mostly idle
            (its decoding step is bound by host-side launches, docs/gpu.md), so two methods take about
            the wall time of one. Same settings and seeds as one after the other.
    """
    bundle, out = Path(bundle).resolve(), Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    settings = with_overrides(read_settings(bundle), overrides or {})
    training = TrainingSettings.from_mapping(settings["training"])  # a bad setting stops the run here
    warm_start = WarmStartSettings.from_mapping(settings["warm_start"])
    device, template = resolve_device(device), settings["prompt_template"]
    train, validation = pd.read_parquet(bundle / "train.parquet"), pd.read_parquet(bundle / "validation.parquet")
    heldout = frame_records(pd.read_json(bundle / "heldout.jsonl", lines=True, dtype=False))[:max_heldout]
    methods = list(methods or settings["methods"])
    timings: dict[str, float] = {}
    clock = functools.partial(stage_clock, timings)
    records: list[dict[str, Any]] = []
    curves: dict[str, list[dict[str, float]]] = {}
    failures: dict[str, str] = {}
    start_validation: dict[str, Any] = {}
    warm_start_metrics: dict[str, float] = {}

    def report() -> dict[str, Any]:
        """Write the outputs as they stand (after each evaluation, so a run cut short keeps them)."""
        trainer = training.trainer
        summary = summarise(records, settings["bootstrap"], reference=REFERENCE, order=methods)
        summary.update({
            "bundle": str(bundle), "heldout": settings["heldout"], "questions": len(heldout), "methods": methods,
            "steps": {m: max((h.get("step", 0) for h in history), default=0) for m, history in curves.items()},
            "failed_methods": failures, "trajectories_per_step": trainer.batch_size,
            "warm_start": warm_start_metrics, "seconds": timings,
            "environment": environment(device, trainer.bf16, bf16_weights=trainer.rollout_weights == "bf16"),
            "overrides": dict(overrides or {}), "rl_seconds": rl_seconds,
        })
        write_outputs(out, summary, records, curves, start_validation.get("metrics", {}))
        return summary

    with search_backend({"mode": "local"}, str(bundle / "index"), where="portable.search") as search:
        with clock("base_model"):
            model_dir = base_model_dir(bundle, settings["base_model"], out / "base_model")
        if warm_start.enabled:
            with clock("warm_start"):
                manifest, warm_start_metrics = stages.warm_start(
                    model_dir, train, validation, search,
                    warm_start.replace(output_dir=str(out / "warm_start"), device=device), template)
            model_dir = manifest["path"]
        with clock("validate_warm_start"):  # step 0 of every method's curve, computed once (as the node does)
            if samples := training.start_validation_samples(validation):
                metrics, identity = stages.validate_start(model_dir, samples, search, training.start_config(device=device),
                                                          template, training.validation)
                start_validation = {"identity": identity, "metrics": metrics}
                free_device(device)

        def evaluate_reference() -> None:
            with clock(f"evaluate_{REFERENCE}"):
                records.extend(evaluate_heldout(REFERENCE, model_dir, heldout, search, settings["evaluation"],
                                                template, device))
            report()

        stage = MethodStage(index_dir=str(bundle / "index"), warm_start_dir=str(model_dir), settings=settings,
                            out=str(out), device=device, start_validation=start_validation, rl_seconds=rl_seconds,
                            train=train, validation=validation, heldout=heldout)
        if parallel_methods and len(methods) > 1:  # the warm start's evaluation beside the methods' RL
            results = run_side_by_side(stage, methods, meanwhile=evaluate_reference)
        else:
            evaluate_reference()
            results = (run_method(stage, method, search) for method in methods)
        for result in results:  # each as it finishes
            timings.update(result.seconds)
            if result.failure is not None:
                failures[result.method] = result.failure
            else:
                curves[result.method] = result.history
                records += result.records
            report()
    return report()
