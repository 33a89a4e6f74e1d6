"""Run a bundle (:mod:`.bundle`) end to end in one process: warm start → RL per method → held-out scores.

The stages are the Kedro chain's, called directly: the warm start
(:func:`spader_pipeline.native.warm_start.warm_start`), the shared step-0 validation, the native
trainer (:func:`spader_pipeline.native.train_native`) per method from the same warm start, and the
held-out evaluation (:func:`spader_pipeline.evaluation.runner.evaluate_dataset`, greedy, with the
in-process index). Output folder::

    summary.json / summary.md   held-out recall and F1 per model with a 95% question-bootstrap
                                interval, each method's paired difference from the warm start, the
                                stage times, the device and the package versions
    heldout_records.jsonl       one evaluation record per model × held-out question
    curves.json / curves.png    validation recall per step per method, the warm start's as a line
    warm_start/, train_<m>/     the models, checkpoints and per-step metrics (metrics.jsonl)

One seed: the intervals are over questions only, and say nothing of the seed-to-seed spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline.portable.bundle import read_settings

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
    from spader_pipeline.data.schema import frame_records
    from spader_pipeline.modeling.device import resolve_device
    from spader_pipeline.retrieval.settings import search_backend

    bundle, out = Path(bundle).resolve(), Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    settings = with_overrides(read_settings(bundle), overrides or {})
    device = resolve_device(device)
    template = settings["prompt_template"]
    train = pd.read_parquet(bundle / "train.parquet")
    validation_frame = pd.read_parquet(bundle / "validation.parquet")
    heldout = frame_records(pd.read_json(bundle / "heldout.jsonl", lines=True, dtype=False))[:max_heldout]
    index_dir = str(bundle / "index")
    methods = list(methods or settings["methods"])
    timings: dict[str, float] = {}
    clock = functools.partial(_stage, timings)

    with clock("base_model"):
        base_path = _base_model(bundle, settings["base_model"], out / "base_model")
    with clock("warm_start"):
        warm_start_dir, warm_start_metrics = _warm_start(base_path, train, validation_frame, index_dir, settings,
                                                         template, out / "warm_start", device)

    records: list[dict[str, Any]] = []
    curves: dict[str, list[dict[str, float]]] = {}
    failures: dict[str, str] = {}
    start_validation: dict[str, Any] = {}

    def report() -> dict[str, Any]:
        """Write the outputs as they stand (after each evaluation, so a run cut short keeps them)."""
        summary = summarise(records, settings["bootstrap"], reference=REFERENCE)
        summary.update({
            "bundle": str(bundle), "heldout": settings["heldout"], "questions": len(heldout), "methods": methods,
            "steps": {m: max((h.get("step", 0) for h in history), default=0) for m, history in curves.items()},
            "failed_methods": failures, "trajectories_per_step": _trajectories_per_step(settings),
            "warm_start": warm_start_metrics, "seconds": timings, "environment": environment(device),
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
        with clock("validate_warm_start"):
            start_validation = _start_validation(warm_start_dir, validation_frame, search, settings, template, device)

        def evaluate_reference() -> None:
            with clock(f"evaluate_{REFERENCE}"):
                records.extend(_evaluate(REFERENCE, warm_start_dir, heldout, search, settings, template, device))
            report()

        stage = MethodStage(index_dir=index_dir, warm_start_dir=str(warm_start_dir), settings=settings, out=str(out),
                            device=device, start_validation=start_validation, rl_seconds=rl_seconds,
                            train=train, validation=validation_frame, heldout=heldout)
        if parallel_methods and len(methods) > 1:  # the warm start's evaluation beside the methods' RL
            results = _run_side_by_side(stage, methods, meanwhile=evaluate_reference)
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


@dataclasses.dataclass(frozen=True)
class MethodStage:
    """What one method's stage (RL from the warm start, then the held-out evaluation) needs, the
    bundle's questions as loaded once: picklable, so that a child process can run it (:func:`run_method`)."""

    index_dir: str
    warm_start_dir: str
    settings: dict[str, Any]
    out: str
    device: str
    start_validation: dict[str, Any]
    rl_seconds: float | None
    train: pd.DataFrame
    validation: pd.DataFrame
    heldout: list[dict[str, Any]]


@dataclasses.dataclass
class MethodResult:
    """A method's validation curve, held-out records and stage times; ``failure`` when it failed."""

    method: str
    history: list[dict[str, Any]]
    records: list[dict[str, Any]]
    seconds: dict[str, float]
    failure: str | None = None


def run_method(stage: MethodStage, method: str, search: Any = None) -> MethodResult:
    """Train ``method`` from the warm start and score it on the held-out set. A failure is returned
    (its traceback logged), not raised, so the other methods still run. ``search``: the open index
    (``None``: open the bundle's, as a child process does)."""
    from spader_pipeline.retrieval.settings import search_backend

    settings = stage.settings
    seconds: dict[str, float] = {}
    clock = functools.partial(_stage, seconds)
    with contextlib.ExitStack() as stack:
        if search is None:
            search = stack.enter_context(search_backend({"mode": "local"}, stage.index_dir,
                                                        where=f"portable.search ({method})"))
        try:
            with clock(f"train_{method}"):
                result = _train(method, stage.warm_start_dir, stage.train, stage.validation, search, settings,
                                settings["prompt_template"], Path(stage.out) / f"train_{method}", stage.device,
                                stage.start_validation, stage.rl_seconds)
            with clock(f"evaluate_{method}"):
                records = _evaluate(method, result.final_model_dir, stage.heldout, search, settings,
                                    settings["prompt_template"], stage.device)
        except Exception as err:  # noqa: BLE001 - recorded in the summary with its traceback in the log
            logger.exception("method %s failed", method)
            _free(stage.device)
            return MethodResult(method, [], [], seconds, f"{type(err).__name__}: {err}")
    return MethodResult(method, list(result.history), records, seconds)


def _run_method_in_child(stage: MethodStage, method: str, threads: int) -> MethodResult:
    """:func:`run_method` in a spawned child: its own logging and its share of the CPU threads."""
    import torch

    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s %(levelname)s [{method}] %(name)s: %(message)s")
    torch.set_num_threads(threads)
    return run_method(stage, method)


def _run_side_by_side(stage: MethodStage, methods: Sequence[str],
                      meanwhile: Callable[[], None] | None = None) -> Iterator[MethodResult]:
    """Each method in its own spawned process, all at once; results in the order they finish. A child
    that dies (killed, out of memory) is reported as that method's failure. ``meanwhile`` runs in this
    process once the children are started, before any result is yielded (the warm start's held-out
    evaluation: it needs none of the methods' results, and the device has room beside them)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // len(methods))
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ProcessPoolExecutor(max_workers=len(methods), mp_context=context) as pool:
        futures = {pool.submit(_run_method_in_child, stage, method, threads): method for method in methods}
        logger.info("methods side by side: %s (%d CPU threads each)", ", ".join(methods), threads)
        if meanwhile is not None:
            meanwhile()
        for future in as_completed(futures):
            method = futures[future]
            try:
                yield future.result()
            except Exception as err:  # noqa: BLE001 - the child died: that method failed, the others stand
                logger.error("method %s: its process failed: %s", method, err)
                yield MethodResult(method, [], [], {}, f"{type(err).__name__}: {err}")


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
    from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model

    convert_packaged_model(PackagedModel(**params.get("packaged", {})), output_dir)
    return str(output_dir)


def _warm_start(base_path: str, train: pd.DataFrame, validation: pd.DataFrame, index_dir: str,
                settings: Mapping[str, Any], template: str, output_dir: Path, device: str) -> tuple[str, dict]:
    params = dict(settings["warm_start"])
    if not params.get("enabled", True):
        return base_path, {}
    from spader_pipeline.native.warm_start import warm_start

    params.update(output_dir=str(output_dir), device=device, search={"mode": "local"})
    manifest, metrics = warm_start(base_path, train, validation, index_dir, params, template)
    return manifest["path"], metrics


def _start_validation(model_dir: str, validation: pd.DataFrame, search: Any, settings: Mapping[str, Any],
                      template: str, device: str) -> dict[str, Any]:
    """Step 0 of every method's validation curve, computed once (as the ``validate_warm_start`` node)."""
    from spader_pipeline.algorithms.validation import ValidationSettings, validation_subset
    from spader_pipeline.data.formats import samples_from_verl
    from spader_pipeline.native import NativeTrainerConfig
    from spader_pipeline.native.validation import validate_model_at
    from spader_pipeline.typed_config import from_mapping

    training = settings["training"]
    schedule = from_mapping(ValidationSettings, training.get("validation"), where="training.validation")
    samples = validation_subset(samples_from_verl(validation), schedule.max_questions)
    if not schedule.before_train or not samples:
        return {}
    config = NativeTrainerConfig.from_mapping({**(training.get("native") or {}), "device": device})
    metrics, identity = validate_model_at(model_dir, samples, search, config, template, batch_size=schedule.batch_size)
    _free(device)
    return {"identity": identity, "metrics": metrics}


def _train(method: str, start_dir: str, train: pd.DataFrame, validation: pd.DataFrame, search: Any,
           settings: Mapping[str, Any], template: str, run_dir: Path, device: str,
           start_validation: Mapping[str, Any], rl_seconds: float | None):
    from spader_pipeline.algorithms.validation import ValidationSettings
    from spader_pipeline.data.formats import samples_from_verl
    from spader_pipeline.native import NativeTrainerConfig, train_native
    from spader_pipeline.typed_config import from_mapping, method_settings

    training = settings["training"]
    values = {**method_settings(training, settings["methods"][method], "native"), "device": device}
    if rl_seconds is not None:
        values["max_seconds"] = rl_seconds
    config = NativeTrainerConfig.from_mapping(values)
    result = train_native(
        config, model_path=start_dir, run_dir=run_dir, prompt_template=template, search=search,
        samples=samples_from_verl(train, training.get("max_train_questions"), config.seed),
        validation=samples_from_verl(validation),
        validation_settings=from_mapping(ValidationSettings, training.get("validation"), where="training.validation"),
        start_validation=start_validation,
    )
    _free(device)
    return result


def _evaluate(name: str, model_dir: str | Path, heldout: list[dict[str, Any]], search: Any,
              settings: Mapping[str, Any], template: str, device: str) -> list[dict[str, Any]]:
    """Greedy records of the model at ``model_dir`` on every held-out question (``model`` = ``name``)."""
    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.rollout import RolloutConfig, SamplingParams
    from spader_pipeline.evaluation.runner import evaluate_dataset
    from spader_pipeline.modeling import load_model_and_tokenizer

    evaluation = settings["evaluation"]
    model, tokenizer = load_model_and_tokenizer(model_dir, device=device)
    generator = HFGenerator(model, tokenizer, SamplingParams.from_mapping(evaluation["sampling"]),
                            micro_batch_size=int(evaluation["batch_size"]),
                            max_prompt_tokens=evaluation.get("max_prompt_tokens"))
    records = asyncio.run(evaluate_dataset(
        heldout, generator, search, RolloutConfig.from_mapping(evaluation["rollout"]), template,
        batch_size=int(evaluation["batch_size"]), concurrency=1, progress=False, description=name))
    del model, generator
    _free(device)
    ok = [r for r in records if r["status"] == "ok"]
    logger.info("held-out %s: recall %.3f, F1 %.3f over %d questions (%d failed)", name,
                float(np.mean([r["recall"] for r in ok])) if ok else float("nan"),
                float(np.mean([r["f1"] for r in ok])) if ok else float("nan"), len(records), len(records) - len(ok))
    return [{**r, "model": name} for r in records]


def summarise(records: Sequence[Mapping[str, Any]], bootstrap: Mapping[str, Any], *, reference: str) -> dict[str, Any]:
    """Held-out recall and F1 per model with question-bootstrap intervals, and each model's paired
    difference from ``reference`` (one seed: ``[1, Q]`` grids of :mod:`spader_pipeline.evaluation.bootstrap`).
    A failed record scores 0, as in the compare report."""
    from spader_pipeline.evaluation.bootstrap import bootstrap_interval, paired_difference

    frame = pd.DataFrame.from_records(list(records))
    options = {k: bootstrap[k] for k in ("resamples", "confidence", "seed") if k in bootstrap}
    scores: dict[str, dict[str, np.ndarray]] = {}
    for model, rows in frame.groupby("model", sort=False):
        rows = rows.sort_values("id")
        ok = rows["status"].eq("ok").to_numpy()
        scores[str(model)] = {m: np.where(ok, rows[m].fillna(0.0).to_numpy(float), 0.0)[None, :]
                              for m in ("recall", "f1")}
        scores[str(model)]["failed"] = int((~ok).sum())
        scores[str(model)]["searches"] = float(rows.loc[ok, "num_searches"].mean()) if ok.any() else float("nan")
    models: dict[str, Any] = {}
    for model, grid in scores.items():
        entry: dict[str, Any] = {"failed": grid["failed"], "searches": grid["searches"]}
        for metric in ("recall", "f1"):
            entry[metric] = bootstrap_interval(grid[metric], **options).as_dict()
            if model != reference and reference in scores:
                diff = paired_difference(scores[reference][metric], grid[metric], **options)
                entry[f"{metric}_minus_{reference}"] = diff.as_dict()
        models[model] = entry
    return {"models": models, "reference": reference, "seeds": 1}


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """The summary's table: one row per model (recall, F1, difference from the reference)."""
    ref = summary["reference"]
    lines = [f"| model | recall [95% CI] | F1 | recall − {ref} [95% CI] | searches | failed |",
             "|---|---|---|---|---|---|"]
    for model, entry in summary["models"].items():
        r, f1 = entry["recall"], entry["f1"]
        diff = entry.get(f"recall_minus_{ref}")
        shown = f"{diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]" if diff else "—"
        lines.append(f"| {model} | {r['mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | {f1['mean']:.3f} | {shown} "
                     f"| {entry['searches']:.2f} | {entry['failed']} |")
    return "\n".join(lines) + "\n"


def plot_curves(curves: Mapping[str, Sequence[Mapping[str, float]]], start: Mapping[str, float], path: Path) -> None:
    """Two panels per RL step, one line per method: validation recall (greedy), the warm start's level
    dashed; and the training batch's recall (sampled, fresh questions each step until the training
    split repeats) beside the policy's entropy, the mechanism behind a sampled gain that greedy
    decoding does not show (a sharper policy samples closer to its greedy answer)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:  # the plot is a convenience; curves.json holds the numbers
        logger.warning("matplotlib is not installed: no %s", path.name)
        return
    fig, (validation, training) = plt.subplots(1, 2, figsize=(11, 4))
    entropy = training.twinx()
    for i, (method, history) in enumerate(curves.items()):
        color = f"C{i}"
        points = [(h["step"], v) for h in history for k, v in h.items() if k.startswith("val/") and k.endswith("/recall")]
        if points:
            validation.plot(*zip(*points, strict=True), marker="o", color=color, label=method)
        sampled = [(h["step"], h["answer/recall"]) for h in history if "answer/recall" in h]
        if sampled:
            training.plot(*zip(*sampled, strict=True), marker="o", color=color, label=f"{method} recall")
        spread = [(h["step"], h["policy/entropy"]) for h in history if "policy/entropy" in h]
        if spread:
            entropy.plot(*zip(*spread, strict=True), marker="x", linestyle=":", color=color, label=f"{method} entropy")
    for key, value in start.items():
        if key.endswith("/recall"):
            validation.axhline(value, linestyle="--", color="grey", label="warm start")
    validation.set(xlabel="RL step", ylabel="validation recall (greedy)", title="held-out validation questions")
    training.set(xlabel="RL step", ylabel="training batch recall (sampled)", title="the step's rollouts")
    entropy.set_ylabel("policy entropy (dotted)")
    for ax in (validation, training):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    validation.legend()
    lines, labels = training.get_legend_handles_labels()
    more, more_labels = entropy.get_legend_handles_labels()
    training.legend(lines + more, labels + more_labels, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: str) -> dict[str, str]:
    """What the run ran on: device name, torch, transformers and Python versions."""
    import torch
    import transformers

    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else (platform.processor() or platform.machine())
    return {"device": device, "device_name": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def _trajectories_per_step(settings: Mapping[str, Any]) -> int:
    """The trainer's batch (questions × group), its defaults included."""
    from spader_pipeline.native import NativeTrainerConfig

    return NativeTrainerConfig.from_mapping(dict(settings["training"].get("native") or {})).batch_size


def _free(device: str) -> None:
    """Give a finished stage's GPU memory back (nothing to do on a CPU)."""
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the stage's wall time in ``timings`` (seconds) and log it."""
    logger.info("stage %s ...", name)
    started = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - started
    logger.info("stage %s: %.1f s", name, timings[name])
