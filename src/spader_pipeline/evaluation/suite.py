"""Every model × every dataset: the evaluation loop, its resources and its resume key.

:func:`evaluate_models` owns the lifetimes: one retrieval service for the whole suite (started on
the index unless a URL is configured, always stopped), one generator per model (an in-process
checkpoint is loaded once for all datasets, in a child process with ``runner.subprocess``; a served
one is started and stopped), one retrieval client per dataset. Each model × dataset is
:func:`spader_pipeline.evaluation.runner.evaluate_dataset` with a work file named by
:func:`resume_key`, and yields an :class:`EvaluationResult` — handed to ``on_result`` as soon as its
model is done (the Kedro node logs it to MLflow there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.child_process import in_child_process
from spader_pipeline.evaluation.config import EvaluationConfig
from spader_pipeline.evaluation.metrics import aggregate
from spader_pipeline.evaluation.models import ModelSpec, open_generator
from spader_pipeline.evaluation.runner import evaluate_dataset, fingerprint
from spader_pipeline.retrieval.settings import service_url

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluationResult:
    """One model on one dataset: every per-sample record and the aggregate metrics."""

    model: ModelSpec
    dataset: str
    records: list[dict[str, Any]]
    """one per sample, in input order (``status`` ok or failed)"""
    metrics: dict[str, float]
    """:func:`spader_pipeline.evaluation.metrics.aggregate` over the successful samples"""
    template_name: str
    rollout: RolloutConfig

    @property
    def num_failed(self) -> int:
        return sum(r["status"] != "ok" for r in self.records)


def select_models(config: EvaluationConfig, from_catalog: Sequence[ModelSpec] = ()) -> list[ModelSpec]:
    """The models to evaluate: those from the catalog, then ``evaluate.models``.

    Raises ``ValueError`` on a duplicate name and
    :class:`~spader_pipeline.evaluation.models.ModelUnavailableError` for an enabled model that
    cannot run here; ``enabled: false`` entries are left out with a log line.
    """
    models = [*from_catalog, *config.models]
    names = [m.name for m in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"evaluate: model names must be unique, {duplicates} appear twice "
                         "(the catalog provides base, warm_start and the trained methods)")
    selected = []
    for model in models:
        if not model.enabled:
            logger.info("evaluate: model %s is disabled (enabled: false)", model.name)
            continue
        model.require_available()
        selected.append(model)
    return selected


def resume_key(
    model: ModelSpec, rollout: RolloutConfig, template: str, dataset: str,
    samples: Sequence[Mapping[str, Any]], index_manifest: Mapping[str, Any], retrieval_url: str | None,
) -> str:
    """Hash of everything that determines a result: model (and its weights), limits, prompt,
    questions, index. A work file is reused only when this key matches."""
    return fingerprint(model.describe(), model.checkpoint_identity(), asdict(rollout), template, dataset,
                       list(samples), dict(index_manifest), retrieval_url)


def prompt_for(model: ModelSpec, config: EvaluationConfig, prompt: Mapping[str, Any]) -> tuple[str, str]:
    """(name, text) of the model's prompt template."""
    name = model.prompt_template or config.prompt_template or prompt["template"]
    templates = prompt.get("templates") or {}
    if name not in templates:
        raise ValueError(f"model {model.name}: prompt template {name!r} is not one of {sorted(templates)}")
    return name, templates[name]


def evaluate_models(
    config: EvaluationConfig,
    models: Sequence[ModelSpec],
    datasets: Mapping[str, list[dict[str, Any]]],
    frequencies: Mapping[str, Mapping[str, list[int]]],
    *,
    index_manifest: Mapping[str, Any],
    prompt: Mapping[str, Any],
    on_result: Callable[[EvaluationResult], None] | None = None,
) -> list[EvaluationResult]:
    """Evaluate every model on every dataset (see the module docstring); results in that order.

    An in-process checkpoint runs in a child process (``runner.subprocess``): its memory returns
    when it ends. ``runner.workers`` > 1 runs that many such children at once, each with its share
    of the torch threads, the costliest first (:func:`_expected_cost`); ``on_result`` then sees each
    model's results as its last child ends. With ``runner.shards`` > 1 each of those models is that
    many children, one per contiguous part of every dataset, so that the last model does not run
    alone while the other workers idle; its records are joined in input order and its metrics
    aggregated over all of them. Served and scripted models run here, one after another.
    """
    if not models or not datasets:
        return []
    done: dict[str, list[EvaluationResult]] = {}

    def finished(model: ModelSpec, results: list[EvaluationResult]) -> None:
        for result in results:
            _log_summary(result)
            if on_result is not None:
                on_result(result)
        done[model.name] = results

    with service_url(config.retrieval, index_manifest["index_dir"]) as url:
        rest = (frequencies, url, index_manifest, prompt)
        children = [m for m in models if config.runner.subprocess and m.kind == "hf"]
        parts = _parts(config.runner.shards, datasets)
        workers, threads = _side_by_side(config.runner.workers, len(children) * parts)
        if workers > 1:
            # one job per model and part, the costliest models first; a model is done when its parts are
            jobs = [(m, k) for m in sorted(children, key=_expected_cost, reverse=True) for k in range(parts)]
            pieces: dict[str, dict[int, list[EvaluationResult]]] = {m.name: {} for m in children}
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="evaluate") as pool:
                futures = {
                    pool.submit(in_child_process(_evaluate_model, name=_job_name(m, k, parts), threads=threads),
                                config, m, _part(datasets, k, parts), *rest): (m, k)
                    for m, k in jobs
                }
                for future in concurrent.futures.as_completed(futures):
                    model, k = futures[future]
                    pieces[model.name][k] = future.result()
                    if len(pieces[model.name]) == parts:
                        finished(model, _joined([pieces[model.name][i] for i in range(parts)], config))
        for model in models:
            if model.name not in done:
                evaluate = in_child_process(_evaluate_model, enabled=model in children, name=f"evaluate_{model.name}")
                finished(model, evaluate(config, model, datasets, *rest))
    return [result for model in models for result in done[model.name]]


def _parts(shards: int, datasets: Mapping[str, Sequence[Any]]) -> int:
    """Parts per model: ``shards``, at most one per question of the largest dataset (no empty child)."""
    return max(1, min(shards, max((len(samples) for samples in datasets.values()), default=1)))


def _part(datasets: Mapping[str, list[dict[str, Any]]], k: int, parts: int) -> dict[str, list[dict[str, Any]]]:
    """The ``k``-th of ``parts`` contiguous slices of every dataset (sizes differ by one at most)."""
    return {name: samples[k * len(samples) // parts:(k + 1) * len(samples) // parts]
            for name, samples in datasets.items()}


def _job_name(model: ModelSpec, k: int, parts: int) -> str:
    return f"evaluate_{model.name}" + (f"_part{k + 1}of{parts}" if parts > 1 else "")


def _joined(parts: Sequence[list[EvaluationResult]], config: EvaluationConfig) -> list[EvaluationResult]:
    """One model's results from its parts (each a list over the datasets, in order): the records
    concatenated in input order and the metrics aggregated over all of them."""
    if len(parts) == 1:
        return list(parts[0])
    joined = []
    for same in zip(*parts, strict=True):  # one dataset's result in every part
        first, records = same[0], [record for part in same for record in part.records]
        joined.append(_result(first.model, first.dataset, records, first.template_name, first.rollout, config))
    return joined


def _result(model: ModelSpec, dataset: str, records: list[dict[str, Any]], template_name: str,
            rollout: RolloutConfig, config: EvaluationConfig) -> EvaluationResult:
    ok = [r for r in records if r["status"] == "ok"]
    metrics = aggregate(ok, num_failed=len(records) - len(ok), long_tail_edges=config.long_tail.edges)
    return EvaluationResult(model, dataset, records, metrics, template_name, rollout)


def _side_by_side(wanted: int, children: int) -> tuple[int, int]:
    """(children at once, torch threads each): ``wanted`` at most, one per child job and at least one
    thread each. torch is imported only when more than one child could run (a served model's
    evaluation needs none)."""
    workers = min(max(1, wanted), children)
    if workers < 2:
        return 1, 0
    import torch

    cores = torch.get_num_threads()
    workers = min(workers, cores)
    return workers, cores // workers


def _expected_cost(model: ModelSpec) -> int:
    """A model's rollout budget in generated tokens (turns × tokens per turn): which child to start first."""
    turns = int(model.rollout.get("max_turns", 1) or 1)
    return turns * int(model.sampling.get("max_new_tokens", 1) or 1)


def _evaluate_model(config: EvaluationConfig, model: ModelSpec, datasets: Mapping[str, list[dict[str, Any]]],
                    frequencies: Mapping[str, Mapping[str, list[int]]], url: str,
                    index_manifest: Mapping[str, Any], prompt: Mapping[str, Any]) -> list[EvaluationResult]:
    """One model on every dataset, searching the service at ``url``."""
    template_name, template = prompt_for(model, config, prompt)
    rollout = RolloutConfig.from_mapping({**config.rollout, **model.rollout})
    results = []
    with open_generator(model) as generator:
        for dataset, samples in datasets.items():
            work_file = None
            if config.runner.resume:
                key = resume_key(model, rollout, template, dataset, samples, index_manifest, config.retrieval.url)
                work_file = Path(config.runner.work_dir) / f"{model.name}__{dataset}__{key}.jsonl"
                work_file.parent.mkdir(parents=True, exist_ok=True)
            records = asyncio.run(_one(config, model, generator, samples, frequencies.get(dataset), url,
                                       rollout, template, work_file, f"{model.name}/{dataset}"))
            results.append(_result(model, dataset, records, template_name, rollout, config))
    return results


async def _one(config, model, generator, samples, frequencies, url, rollout, template, work_file, description):
    from spader_pipeline.retrieval import RetrievalClient

    in_process = model.kind == "hf"  # one batched forward pass at a time; endpoints take concurrent calls
    async with RetrievalClient(url, timeout=config.retrieval.timeout, max_retries=config.retrieval.max_retries) as client:
        try:
            return await evaluate_dataset(
                samples, generator, client, rollout, template,
                batch_size=_batch_size(model, generator, rollout) if in_process else 1,
                concurrency=1 if in_process else model.concurrency,
                max_attempts=config.runner.max_attempts,
                retry_on_search_error=config.runner.retry_on_search_error,
                corpus_frequency=frequencies,
                work_file=work_file,
                progress=config.runner.progress,
                description=description,
            )
        finally:
            await generator.aclose()


def evaluate_manifests(
    params: Mapping[str, Any],
    manifests: Mapping[str, Mapping[str, Any]],
    datasets: Mapping[str, list[dict[str, Any]]],
    frequencies: Mapping[str, Mapping[str, list[int]]],
    *,
    index_manifest: Mapping[str, Any],
    prompt: Mapping[str, Any],
    links: Callable[[Mapping[str, Any]], Mapping[str, str]] = lambda manifest: {},
    on_result: Callable[[EvaluationResult], None] | None = None,
) -> list[EvaluationResult]:
    """The models of ``manifests`` (name → catalog manifest), then those of ``params.models``, on
    every dataset. ``links`` gives a manifest's tags that link it to its training run."""
    config = EvaluationConfig.from_mapping(params)
    unknown = sorted(set(config.catalog_overrides) - set(manifests))
    if unknown:
        raise ValueError(f"evaluate.catalog_overrides names {unknown}, not models of the catalog "
                         f"({sorted(manifests)})")
    from_catalog = [
        ModelSpec.from_manifest(name, manifest, config.catalog_settings(name), source=f"the catalog's {name} manifest",
                                training_link=dict(links(manifest)))
        for name, manifest in manifests.items()
    ]
    return evaluate_models(config, select_models(config, from_catalog), datasets, frequencies,
                           index_manifest=index_manifest, prompt=prompt, on_result=on_result)


def records_frame(results: Sequence[EvaluationResult]) -> Any:
    """Per-sample records of ``results`` as one frame, with ``model`` and ``dataset`` first."""
    import pandas as pd

    return pd.DataFrame([{"model": r.model.name, "dataset": r.dataset, **record} for r in results
                         for record in r.records])


def _log_summary(result: EvaluationResult) -> None:
    m, failed = result.metrics, result.num_failed
    if failed:
        logger.warning("evaluate %s/%s: %d of %d samples failed after retries (kept as status=failed)",
                       result.model.name, result.dataset, failed, len(result.records))
    logger.info("evaluate %s/%s: P=%.3f R=%.3f F1=%.3f (%d samples, %d failed)", result.model.name, result.dataset,
                *(m.get(k, math.nan) for k in ("precision", "recall", "f1")), len(result.records) - failed, failed)


def _batch_size(model, generator, rollout) -> int:
    """``batch_size``, cut so that a batch's KV caches fit ``kv_cache_budget_mb`` when it is set
    (:func:`spader_pipeline.modeling.memory_budget.rows_within_budget`; the same records)."""
    budget = model.options.get("kv_cache_budget_mb")
    if not budget:
        return model.batch_size
    from spader_pipeline.modeling.memory_budget import rows_within_budget

    tokens = (generator.layout.max_prompt_tokens or 0) + rollout.max_response_tokens
    rows = rows_within_budget(generator.model.config, tokens, budget, limit=model.batch_size)
    if rows < model.batch_size:
        logger.info("%s: batches of %d rows (of %d) keep the KV caches within %s MiB", model.name, rows,
                    model.batch_size, budget)
    return rows
