"""Thin nodes around :mod:`spader_pipeline.evaluation` (runner, metrics) and the retrieval service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import pandas as pd  # noqa: E402

from spader_pipeline import tracking  # noqa: E402
from spader_pipeline.agent.rollout import RolloutConfig  # noqa: E402
from spader_pipeline.evaluation.metrics import (  # noqa: E402
    DEFAULT_LONG_TAIL_EDGES,
    aggregate,
    bucket_labels,
    entity_corpus_frequency,
)
from spader_pipeline.evaluation.runner import ModelSpec, evaluate_dataset, fingerprint, open_generator  # noqa: E402

logger = logging.getLogger(__name__)

#: Columns of the comparison table, first, in this order.
TABLE_HEAD = ["model", "dataset", "num_samples", "num_failed", "precision", "recall", "f1", "exact_match"]


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    for row in frame.to_dict(orient="records"):
        gt = [[str(a) for a in entity] for entity in row["ground_truth"]]
        rows.append(
            {
                "id": str(row["id"]),
                "question": str(row["question"]),
                "ground_truth": gt,
                "data_source": row.get("data_source"),
            }
        )
    return rows


def select_eval_sets(
    eval_sets: Mapping[str, Callable[[], pd.DataFrame]], params: Mapping[str, Any]
) -> dict[str, list[dict]]:
    """The configured evaluation sets that exist: partitions of ``eval_sets`` named in
    ``params.datasets`` plus ``params.extra_files`` (name → jsonl path), each capped at ``max_samples``."""
    selected: dict[str, list[dict]] = {}
    for name in params.get("datasets") or []:
        if name not in eval_sets:
            logger.info("evaluation set %s not present (available: %s); skipped", name, sorted(eval_sets))
            continue
        selected[name] = _records(eval_sets[name]())
    for name, path in (params.get("extra_files") or {}).items():
        if not Path(path).is_file():
            logger.info("evaluation file %s (%s) not found; skipped", name, path)
            continue
        selected[name] = _records(pd.read_json(path, lines=True, dtype={"id": str}))
    limit = params.get("max_samples")
    if limit:
        selected = {k: v[: int(limit)] for k, v in selected.items()}
    for name, rows in selected.items():
        logger.info("evaluation set %s: %d questions", name, len(rows))
    return selected


def count_entity_frequencies(
    selected: Mapping[str, list[dict]], corpus: pd.DataFrame, params: Mapping[str, Any]
) -> dict[str, dict[str, list[int]]]:
    """Per dataset and sample id, in how many corpus passages each gold entity occurs (long-tail buckets)."""
    if not params.get("long_tail", {}).get("enabled", True) or not selected:
        return {}
    texts = (
        corpus["title"].fillna("").astype(str) + "\n" + corpus["contents"].fillna("").astype(str)
    ).tolist()
    out: dict[str, dict[str, list[int]]] = {}
    for name, rows in selected.items():
        freqs = entity_corpus_frequency([r["ground_truth"] for r in rows], texts)
        out[name] = {r["id"]: f for r, f in zip(rows, freqs, strict=True)}
    return out


@contextlib.contextmanager
def _retrieval_url(params: Mapping[str, Any], index_manifest: Mapping[str, Any]) -> Iterator[str]:
    url = params.get("url")
    if url:
        yield url
        return
    from spader_pipeline.retrieval import running_service

    with running_service(
        index_manifest["index_dir"], startup_timeout=params.get("startup_timeout", 180)
    ) as started:
        yield started


def _template(spec: ModelSpec, params: Mapping[str, Any], prompt: Mapping[str, Any]) -> tuple[str, str]:
    name = spec.prompt_template or params.get("prompt_template") or prompt["template"]
    templates = prompt.get("templates") or {}
    if name not in templates:
        raise ValueError(f"model {spec.name}: prompt template {name!r} is not one of {sorted(templates)}")
    return name, templates[name]


def _evaluate(
    spec, generator, samples, frequencies, url, rollout, template, params, dataset, index
) -> list[dict]:
    runner = params.get("runner", {})
    retrieval = params.get("retrieval", {})
    work_file = None
    if runner.get("resume", True):
        work_dir = Path(runner.get("work_dir", "data/07_model_output/eval_work"))
        work_dir.mkdir(parents=True, exist_ok=True)
        # Resume only reuses results of the same model (and weights), limits, prompt, questions and index.
        key = fingerprint(
            spec.describe(),
            spec.checkpoint_identity(),
            asdict(rollout),
            template,
            dataset,
            samples,
            index,
            params.get("retrieval", {}).get("url"),
        )
        work_file = work_dir / f"{spec.name}__{dataset}__{key}.jsonl"
    hf = spec.kind == "hf"

    async def go() -> list[dict]:
        from spader_pipeline.retrieval import RetrievalClient

        async with RetrievalClient(
            url, timeout=retrieval.get("timeout", 30.0), max_retries=retrieval.get("max_retries", 3)
        ) as client:
            try:
                return await evaluate_dataset(
                    samples,
                    generator,
                    client,
                    rollout,
                    template,
                    batch_size=spec.batch_size if hf else 1,
                    concurrency=1 if hf else spec.concurrency,
                    max_attempts=runner.get("max_attempts", 3),
                    retry_on_search_error=runner.get("retry_on_search_error", True),
                    corpus_frequency=frequencies,
                    work_file=work_file,
                    progress=runner.get("progress", True),
                    description=f"{spec.name}/{dataset}",
                )
            finally:
                await generator.aclose()

    return asyncio.run(go())


def _sample_plot(records: list[dict], agg: Mapping[str, float], edges, title: str) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    f1 = [r["f1"] for r in records if r.get("status") == "ok"]
    left.hist(f1, bins=10, range=(0, 1), color="#4c72b0")
    left.set(xlabel="F1 per question", ylabel="questions", title="F1 distribution")
    labels = bucket_labels(edges)
    values = [agg.get(f"long_tail_recall/{label}", math.nan) for label in labels]
    right.bar(labels, [0 if math.isnan(v) else v for v in values], color="#55a868")
    right.set(xlabel="passages mentioning the entity", ylabel="recall", ylim=(0, 1), title="Long-tail recall")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _log_evaluation(spec, dataset, template_name, rollout, records, agg, edges) -> None:
    """One nested MLflow run per model × dataset: params, metrics, per-sample file, plot."""
    if not tracking.active():
        return
    with (
        mlflow.start_run(run_name=f"evaluate:{spec.name}:{dataset}", nested=True),
        tempfile.TemporaryDirectory() as tmp,
    ):
        mlflow.set_tags(
            {"evaluate.model": spec.name, "evaluate.dataset": dataset, "evaluate.kind": spec.kind}
        )
        tracking.log_params(
            {
                **spec.describe(),
                "dataset": dataset,
                "prompt_template": template_name,
                **{f"rollout.{k}": v for k, v in asdict(rollout).items()},
            }
        )
        tracking.log_metrics(agg)
        path = Path(tmp) / f"{spec.name}__{dataset}.jsonl"
        path.write_text(
            "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records), encoding="utf-8"
        )
        tracking.log_artifact(path, "samples")
        fig = _sample_plot(records, agg, edges, f"{spec.name} on {dataset}")
        png = Path(tmp) / f"{spec.name}__{dataset}.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        tracking.log_artifact(png, "plots")


def run_evaluations_after(selected, frequencies, index_manifest, params, prompt, *upstream):
    """:func:`run_evaluations`, scheduled after the datasets in ``upstream`` exist (e.g. the trained
    checkpoints' manifests in the default run); their values are not used."""
    return run_evaluations(selected, frequencies, index_manifest, params, prompt)


def run_evaluations(
    selected: Mapping[str, list[dict]],
    frequencies: Mapping[str, Mapping[str, list[int]]],
    index_manifest: Mapping[str, Any],
    params: Mapping[str, Any],
    prompt: Mapping[str, Any],
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """Every available model × every selected dataset. Returns per-sample records (all samples,
    failed ones included with ``status="failed"``), the table (one row per model × dataset) and
    the flat metrics dict the MLflow hook logs (``<model>/<dataset>/<metric>``)."""
    edges = tuple(params.get("long_tail", {}).get("edges", DEFAULT_LONG_TAIL_EDGES))
    specs = [ModelSpec.from_mapping(m) for m in params.get("models") or []]
    available = []
    for spec in specs:
        reason = spec.unavailable_reason()
        if reason:
            logger.warning("evaluate: skipping model %s: %s", spec.name, reason)
        else:
            available.append(spec)
    samples_out: list[dict] = []
    table: list[dict] = []
    metrics: dict[str, float] = {}
    if available and selected:
        with _retrieval_url(params.get("retrieval", {}), index_manifest) as url:
            for spec in available:
                template_name, template = _template(spec, params, prompt)
                rollout = RolloutConfig.from_mapping({**(params.get("rollout") or {}), **spec.rollout})
                with open_generator(spec) as generator:
                    for dataset, samples in selected.items():
                        records = _evaluate(
                            spec,
                            generator,
                            samples,
                            frequencies.get(dataset),
                            url,
                            rollout,
                            template,
                            params,
                            dataset,
                            index_manifest,
                        )
                        ok = [r for r in records if r["status"] == "ok"]
                        failed = len(records) - len(ok)
                        if failed:
                            logger.warning(
                                "evaluate %s/%s: %d of %d samples failed after retries (kept as status=failed)",
                                spec.name,
                                dataset,
                                failed,
                                len(records),
                            )
                        agg = aggregate(ok, num_failed=failed, long_tail_edges=edges)
                        table.append({"model": spec.name, "dataset": dataset, **agg})
                        metrics.update(
                            {f"{spec.name}/{dataset}/{k}": v for k, v in agg.items() if not math.isnan(v)}
                        )
                        samples_out.extend({"model": spec.name, "dataset": dataset, **r} for r in records)
                        _log_evaluation(spec, dataset, template_name, rollout, records, agg, edges)
                        logger.info(
                            "evaluate %s/%s: P=%.3f R=%.3f F1=%.3f (%d samples, %d failed)",
                            spec.name,
                            dataset,
                            agg["precision"],
                            agg["recall"],
                            agg["f1"],
                            len(ok),
                            failed,
                        )
    frame = pd.DataFrame(table)
    if not frame.empty:
        frame = frame[TABLE_HEAD + [c for c in frame.columns if c not in TABLE_HEAD]]
    return pd.DataFrame(samples_out), frame, metrics


def plot_comparison(table: pd.DataFrame) -> plt.Figure:
    """Precision, recall and F1 of every model, one panel per dataset."""
    datasets = list(dict.fromkeys(table["dataset"])) if not table.empty else []
    fig, axes = plt.subplots(
        1, max(1, len(datasets)), figsize=(4.5 * max(1, len(datasets)), 3.6), squeeze=False
    )
    if not datasets:
        axes[0][0].text(0.5, 0.5, "no evaluations ran", ha="center", va="center")
        axes[0][0].set_axis_off()
        return fig
    metrics = ["precision", "recall", "f1"]
    for ax, dataset in zip(axes[0], datasets, strict=True):
        rows = table[table["dataset"] == dataset]
        width = 0.8 / len(metrics)
        for i, metric in enumerate(metrics):
            xs = [j + i * width for j in range(len(rows))]
            ax.bar(xs, rows[metric].fillna(0).tolist(), width=width, label=metric)
        ax.set_xticks([j + width for j in range(len(rows))], rows["model"].tolist(), rotation=20)
        ax.set(ylim=(0, 1), title=dataset)
    axes[0][0].legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig
