"""Run a bundle (:mod:`.bundle`) end to end in one process: warm start → RL per method → held-out scores.

This module reads the bundle and orders the stages; the stages are the Kedro chain's, called
directly with one open in-process index: the warm start (:func:`spader_pipeline.native.stages.warm_start`),
the shared step-0 validation (:func:`~spader_pipeline.native.stages.validate_start`), then per method
from the same warm start the native trainer (:func:`~spader_pipeline.native.stages.train`) and the
held-out evaluation (:mod:`spader_pipeline.portable.methods`). The summary, its table and the curves
are :mod:`spader_pipeline.reporting.portable`'s. Output folder::

    summary.json / summary.md   held-out recall and F1 per model with a 95% question-bootstrap
                                interval, each method's paired difference from the warm start, the
                                stage times, the device, the package versions and the decoding path
    heldout_records.jsonl       one evaluation record per model × held-out question
    curves.json / curves.png    validation recall per step per method, the warm start's as a line
    warm_start/, train_<m>/     the models, checkpoints and per-step metrics (metrics.jsonl)

One seed: the intervals are over questions only, and say nothing of the seed-to-seed spread.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from spader_pipeline.algorithms.validation import validation_subset
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.data.schema import frame_records
from spader_pipeline.modeling.device import resolve_device
from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model
from spader_pipeline.native import stages
from spader_pipeline.portable.bundle import read_settings
from spader_pipeline.portable.methods import (
    MethodStage,
    evaluate_heldout,
    free_device,
    run_method,
    run_side_by_side,
    stage_clock,
)
from spader_pipeline.reporting.portable import environment, plot_curves, summarise, summary_markdown
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
    device = resolve_device(device)
    template = settings["prompt_template"]
    train = pd.read_parquet(bundle / "train.parquet")
    validation_frame = pd.read_parquet(bundle / "validation.parquet")
    heldout = frame_records(pd.read_json(bundle / "heldout.jsonl", lines=True, dtype=False))[:max_heldout]
    index_dir = str(bundle / "index")
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
        trainer = training.start_config()
        summary = summarise(records, settings["bootstrap"], reference=REFERENCE)
        summary.update({
            "bundle": str(bundle), "heldout": settings["heldout"], "questions": len(heldout), "methods": methods,
            "steps": {m: max((h.get("step", 0) for h in history), default=0) for m, history in curves.items()},
            "failed_methods": failures, "trajectories_per_step": trainer.batch_size,
            "warm_start": warm_start_metrics, "seconds": timings,
            "environment": environment(device, trainer.bf16, bf16_weights=trainer.rollout_weights == "bf16"),
            "overrides": dict(overrides or {}), "rl_seconds": rl_seconds,
        })
        with (out / "heldout_records.jsonl").open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
        (out / "curves.json").write_text(json.dumps(curves, indent=1, default=float))
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        (out / "summary.md").write_text(summary_markdown(summary))
        plot_curves(curves, start_validation.get("metrics", {}), out / "curves.png")
        return summary

    with search_backend({"mode": "local"}, index_dir, where="portable.search") as search:
        with clock("base_model"):
            base_path = _base_model(bundle, settings["base_model"], out / "base_model")
        with clock("warm_start"):
            warm_start_dir, warm_start_metrics = _warm_start(base_path, train, validation_frame, search, settings,
                                                             out / "warm_start", device)
        with clock("validate_warm_start"):
            start_validation = _start_validation(warm_start_dir, validation_frame, search, training, template, device)

        def evaluate_reference() -> None:
            with clock(f"evaluate_{REFERENCE}"):
                records.extend(evaluate_heldout(REFERENCE, warm_start_dir, heldout, search, settings["evaluation"],
                                                template, device))
            report()

        stage = MethodStage(index_dir=index_dir, warm_start_dir=str(warm_start_dir), settings=settings, out=str(out),
                            device=device, start_validation=start_validation, rl_seconds=rl_seconds,
                            train=train, validation=validation_frame, heldout=heldout)
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
    summary = report()
    return summary


def with_overrides(settings: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with each ``"a.b.c": value`` of ``overrides`` set (a copy; a missing parent is an error)."""
    out = json.loads(json.dumps(settings))
    for dotted, value in overrides.items():
        *parents, key = dotted.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise KeyError(f"override {dotted!r}: the settings have no block {part!r}")
            node = node[part]
        node[key] = value
    return out


def _base_model(bundle: Path, params: Mapping[str, Any], output_dir: Path) -> str:
    """The base model's folder: the bundled one, or the packaged GGUF converted into ``output_dir``."""
    if params.get("path"):
        return str((bundle / params["path"]).resolve())
    convert_packaged_model(PackagedModel(**params.get("packaged", {})), output_dir)
    return str(output_dir)


def _warm_start(base_path: str, train: pd.DataFrame, validation: pd.DataFrame, search: Any,
                settings: Mapping[str, Any], output_dir: Path, device: str) -> tuple[str, dict]:
    """The warm start stage (``warm_start`` settings) into ``output_dir``: its model's folder and metrics."""
    params = dict(settings["warm_start"])
    if not params.get("enabled", True):
        return base_path, {}
    params.update(output_dir=str(output_dir), device=device, search={"mode": "local"})
    manifest, metrics = stages.warm_start(base_path, train, validation, search, params, settings["prompt_template"])
    return manifest["path"], metrics


def _start_validation(model_dir: str, validation: pd.DataFrame, search: Any, training: TrainingSettings,
                      template: str, device: str) -> dict[str, Any]:
    """Step 0 of every method's validation curve, computed once (as the ``validate_warm_start`` node)."""
    samples = validation_subset(samples_from_verl(validation), training.validation.max_questions)
    if not training.validation.before_train or not samples:
        return {}
    metrics, identity = stages.validate_start(model_dir, samples, search, training.start_config(device=device),
                                              template, training.validation.batch_size)
    free_device(device)
    return {"identity": identity, "metrics": metrics}
