"""Run an agent over an evaluation set: bounded concurrency, progress, resume, retries, no silent drops.

:func:`evaluate_dataset` rolls out every sample of one dataset with one model and returns one
record per sample — ``status: "ok"`` with every metric of :mod:`.metrics`, or ``status: "failed"``
with the error after ``max_attempts`` tries. Finished records are appended to a work file as they
complete, so an interrupted evaluation resumes where it stopped (ids already done are skipped).

Which models are evaluated, and their generators, live in :mod:`.models`; the model × dataset
loop with its resources and resume key in :mod:`.suite`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from spader_pipeline.agent.rollout import run_rollouts
from spader_pipeline.agent.types import Generator, RolloutConfig, SearchBackend, Trajectory
from spader_pipeline.algorithms.matching import normalize_ground_truth
from spader_pipeline.data.schema import sample_record
from spader_pipeline.evaluation.metrics import sample_metrics

logger = logging.getLogger(__name__)

def fingerprint(*parts: Any) -> str:
    """Short stable hash of the configuration that produced a set of results (resume key)."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def trajectory_record(
    sample: Mapping[str, Any], trajectory: Trajectory, corpus_frequency: Sequence[int] | None
) -> dict[str, Any]:
    """The per-sample record: identity, history, prediction, steps and every metric."""
    assistant = [s.text for s in trajectory.steps]
    canonical = normalize_ground_truth(sample["ground_truth"]).canonical
    found = trajectory.entities_found(sample["ground_truth"])
    record: dict[str, Any] = dict(sample_record(sample, trajectory, status="ok"))
    record["steps"] = [
        {
            "turn": s.turn,
            "kind": s.kind,
            "queries": list(s.queries),
            "doc_ids": s.doc_ids,
            "entities_found": [canonical[i] for i in hits],
            "error": s.error,
        }
        for s, hits in zip(trajectory.steps, found, strict=True)
    ]
    record.update(
        sample_metrics(
            predicted=trajectory.predicted,
            ground_truth=sample["ground_truth"],
            assistant_turns=assistant,
            num_searches=trajectory.num_searches,
            num_queries=trajectory.num_queries,
            num_invalid_turns=trajectory.num_invalid_turns,
            retrieved_texts=trajectory.retrieved_texts,
            corpus_frequency=corpus_frequency,
        )
    )
    return record


def failure_record(sample: Mapping[str, Any], error: str, attempts: int) -> dict[str, Any]:
    """The record of a sample whose rollout failed ``attempts`` times: its question and the error."""
    return {**sample_record(sample, status="failed"), "error": error, "attempts": attempts}


def _attempt_error(trajectory: Trajectory, search_errors_fail: bool) -> str | None:
    """Why this rollout does not count as a valid evaluation of the sample (None when it does)."""
    if trajectory.finish_reason == "error":
        return trajectory.error or "generation failed"
    if search_errors_fail:
        failed = [s.error for s in trajectory.steps if s.error_kind == "search_failed"]
        if failed:
            return failed[0]
    return None


def read_work_file(path: Path) -> dict[str, dict[str, Any]]:
    """Records already finished (status ok) in a work file; a torn last line is ignored."""
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("status") == "ok":
            done[str(record["id"])] = record
    return done


async def evaluate_dataset(
    samples: Sequence[Mapping[str, Any]],
    generator: Generator,
    search: SearchBackend,
    config: RolloutConfig,
    template: str,
    *,
    batch_size: int = 1,
    concurrency: int = 4,
    max_attempts: int = 3,
    corpus_frequency: Mapping[str, Sequence[int]] | None = None,
    work_file: Path | None = None,
    progress: bool = True,
    description: str = "evaluate",
    on_record: Callable[[dict[str, Any]], None] | None = None,
    retry_on_search_error: bool = True,
) -> list[dict[str, Any]]:
    """One record per sample, in input order (see the module docstring).

    Samples are rolled out in groups of ``batch_size`` (one batched generation per round), with at
    most ``concurrency`` groups in flight. A trajectory whose generator failed is retried alone up
    to ``max_attempts`` times in total, then recorded as failed. With ``retry_on_search_error`` a
    trajectory during which the search service failed counts as a failed attempt too: its score
    would measure the infrastructure, not the agent. Records already in ``work_file`` are reused,
    new ones appended to it.
    """
    done = read_work_file(work_file) if work_file else {}
    todo = [s for s in samples if str(s["id"]) not in done]
    if done:
        logger.info(
            "%s: resuming, %d of %d samples already done", description, len(samples) - len(todo), len(samples)
        )
    results: dict[str, dict[str, Any]] = dict(done)
    frequencies = corpus_frequency or {}
    semaphore = asyncio.Semaphore(max(1, concurrency))
    bar = tqdm(
        total=len(samples),
        initial=len(samples) - len(todo),
        desc=description,
        disable=not progress,
        leave=False,
    )
    handle = work_file.open("a", encoding="utf-8") if work_file else None

    def finish(record: dict[str, Any]) -> None:
        results[record["id"]] = record
        if handle is not None and record["status"] == "ok":
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
        if on_record is not None:
            on_record(record)
        bar.update(1)

    async def run_group(group: list[Mapping[str, Any]]) -> None:
        attempts = {str(s["id"]): 0 for s in group}
        pending = list(group)
        while pending:
            async with semaphore:
                try:
                    trajectories = await run_rollouts(pending, generator, search, config, template)
                    errors = [_attempt_error(t, retry_on_search_error) for t in trajectories]
                except ImportError:  # a broken installation: every attempt would fail alike
                    raise
                except Exception as exc:  # noqa: BLE001 - counted and retried, never lost
                    logger.warning("%s: rollout of %d samples raised %r", description, len(pending), exc)
                    trajectories = [None] * len(pending)
                    errors = [f"{exc.__class__.__name__}: {exc}"] * len(pending)
            retry = []
            for sample, trajectory, error in zip(pending, trajectories, errors, strict=True):
                sid = str(sample["id"])
                attempts[sid] += 1
                if error is None:
                    finish(trajectory_record(sample, trajectory, frequencies.get(sid)))
                elif attempts[sid] < max_attempts:
                    retry.append(sample)
                else:
                    logger.warning(
                        "%s: sample %s failed %d times: %s", description, sid, attempts[sid], error
                    )
                    finish(failure_record(sample, error, attempts[sid]))
            pending = retry

    try:
        groups = [todo[i : i + max(1, batch_size)] for i in range(0, len(todo), max(1, batch_size))]
        await asyncio.gather(*(run_group(g) for g in groups))
    finally:
        bar.close()
        if handle is not None:
            handle.close()
    return [results[str(s["id"])] for s in samples]
