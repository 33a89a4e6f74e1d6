"""A method's stage of the portable run, and the methods side by side.

:func:`run_method` trains one method from the shared warm start (:func:`train_method`, the native
stage the Kedro node runs) and scores it greedy on the held-out questions (:func:`evaluate_heldout`);
a failure is returned, so the other methods still run. :func:`run_side_by_side` runs each method in a
spawned child process of its own, all at once, on the same device.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.evaluation.runner import evaluate_dataset
from spader_pipeline.native import stages
from spader_pipeline.retrieval.settings import search_backend
from spader_pipeline.training import TrainingSettings

if TYPE_CHECKING:
    from spader_pipeline.native.trainer import TrainResult

logger = logging.getLogger(__name__)


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
    seconds: dict[str, float] = {}
    clock = functools.partial(stage_clock, seconds)
    with contextlib.ExitStack() as stack:
        if search is None:
            search = stack.enter_context(search_backend({"mode": "local"}, stage.index_dir,
                                                        where=f"portable.search ({method})"))
        try:
            with clock(f"train_{method}"):
                result = train_method(stage, method, search)
            with clock(f"evaluate_{method}"):
                records = evaluate_heldout(method, result.final_model_dir, stage.heldout, search,
                                           stage.settings["evaluation"], stage.settings["prompt_template"], stage.device)
        except Exception as err:  # noqa: BLE001 - recorded in the summary with its traceback in the log
            logger.exception("method %s failed", method)
            free_device(stage.device)
            return MethodResult(method, [], [], seconds, f"{type(err).__name__}: {err}")
    return MethodResult(method, list(result.history), records, seconds)


def run_method_in_child(stage: MethodStage, method: str, threads: int) -> MethodResult:
    """:func:`run_method` in a spawned child: its own logging and its share of the CPU threads."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s %(levelname)s [{method}] %(name)s: %(message)s")
    torch.set_num_threads(threads)
    return run_method(stage, method)


def run_side_by_side(stage: MethodStage, methods: Sequence[str],
                      meanwhile: Callable[[], None] | None = None) -> Iterator[MethodResult]:
    """Each method in its own spawned process, all at once; results in the order they finish. A child
    that dies (killed, out of memory) is reported as that method's failure. ``meanwhile`` runs in this
    process once the children are started, before any result is yielded (the warm start's held-out
    evaluation: it needs none of the methods' results, and the device has room beside them)."""
    threads = max(1, (os.cpu_count() or 1) // len(methods))
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ProcessPoolExecutor(max_workers=len(methods), mp_context=context) as pool:
        futures = {pool.submit(run_method_in_child, stage, method, threads): method for method in methods}
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


def train_method(stage: MethodStage, method: str, search: Any) -> TrainResult:
    """RL of ``method`` from the warm start: the native stage :func:`spader_pipeline.native.stages.train`
    (the one the Kedro node runs), its configuration built from the bundle's ``training`` settings
    and the method's block (:meth:`~spader_pipeline.training.TrainingSettings.trainer_config`)."""
    settings = TrainingSettings.from_mapping(stage.settings["training"], stage.settings["methods"][method])
    budget = {} if stage.rl_seconds is None else {"max_seconds": stage.rl_seconds}
    result = stages.train(settings.trainer_config(device=stage.device, **budget), model_path=stage.warm_start_dir,
                          verl_train=stage.train, verl_validation=stage.validation, search=search,
                          run_dir=Path(stage.out) / f"train_{method}", template=stage.settings["prompt_template"],
                          max_train_questions=settings.max_train_questions, validation_settings=settings.validation,
                          start_validation=stage.start_validation)
    free_device(stage.device)
    return result


def evaluate_heldout(name: str, model_dir: str | Path, heldout: list[dict[str, Any]], search: Any,
                     evaluation: Mapping[str, Any], template: str, device: str) -> list[dict[str, Any]]:
    """Greedy records of the model at ``model_dir`` on every held-out question (``model`` = ``name``):
    the evaluator's :func:`~spader_pipeline.evaluation.runner.evaluate_dataset` in this process, with
    the bundle's ``evaluation`` limits and rollout engine (``hf`` in bundles that name none)."""
    from spader_pipeline.agent.engines import DEFAULT_ENGINE, build_generator
    from spader_pipeline.modeling import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir, device=device)
    generator = build_generator(evaluation.get("engine") or DEFAULT_ENGINE, model, tokenizer,
                                SamplingParams.from_mapping(evaluation["sampling"]),
                                micro_batch_size=int(evaluation["batch_size"]),
                                max_prompt_tokens=evaluation.get("max_prompt_tokens"))
    records = asyncio.run(evaluate_dataset(
        heldout, generator, search, RolloutConfig.from_mapping(evaluation["rollout"]), template,
        batch_size=int(evaluation["batch_size"]), concurrency=1, progress=False, description=name))
    del model, generator
    free_device(device)
    ok = [r for r in records if r["status"] == "ok"]
    logger.info("held-out %s: recall %.3f, F1 %.3f over %d questions (%d failed)", name,
                float(np.mean([r["recall"] for r in ok])) if ok else float("nan"),
                float(np.mean([r["f1"] for r in ok])) if ok else float("nan"), len(records), len(records) - len(ok))
    return [{**r, "model": name} for r in records]


def free_device(device: str) -> None:
    """Give a finished stage's GPU memory back (nothing to do on a CPU)."""
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def stage_clock(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the stage's wall time in ``timings`` (seconds) and log it."""
    logger.info("stage %s ...", name)
    started = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - started
    logger.info("stage %s: %.1f s", name, timings[name])
