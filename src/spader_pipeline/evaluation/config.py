"""The typed ``evaluate`` block of ``conf/base/parameters_evaluate.yml``.

One dataclass per concern, built strictly (:func:`spader_pipeline.typed_config.from_mapping`:
an unknown or misspelt key is an error that lists the known ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spader_pipeline.evaluation.metrics import DEFAULT_LONG_TAIL_EDGES
from spader_pipeline.evaluation.models import ModelSpec
from spader_pipeline.retrieval.settings import RetrievalSettings, retrieval_settings
from spader_pipeline.typed_config import from_mapping


@dataclass(frozen=True)
class RunnerSettings:
    """Retries, resume and progress of :func:`spader_pipeline.evaluation.runner.evaluate_dataset`."""

    max_attempts: int = 3
    """a sample whose rollout fails is retried until this many attempts, then counted as failed"""
    retry_on_search_error: bool = True
    """a rollout during which the search service failed is a failed attempt too"""
    resume: bool = True
    """append finished samples to a work file keyed by the configuration; a rerun skips them"""
    work_dir: str = "data/07_model_output/eval_work"
    """where the work files live"""
    progress: bool = True
    """tqdm progress bars"""
    subprocess: bool = True
    """each in-process (``hf``) model is evaluated in a child process, which returns its memory to
    the operating system when it ends (:mod:`spader_pipeline.child_process`)"""
    workers: int = 1
    """with ``subprocess``: how many of those children run at once, each with its share of this
    process's torch threads (at least one); the costliest models start first"""
    shards: int = 1
    """with ``workers`` > 1: each of those models is this many children, one per contiguous part of
    every dataset (its records joined in input order), so that the last model does not run alone while
    the other workers idle. A part is decoded in batches of its own: under bf16, where a batch's
    composition changes the sums, its trajectories can differ from those of the whole set in one child"""


@dataclass(frozen=True)
class LongTailSettings:
    """Long-tail recall: gold entities bucketed by how many corpus passages mention them."""

    enabled: bool = True
    edges: tuple[float, ...] = DEFAULT_LONG_TAIL_EDGES
    """bucket edges (default 1, 2, 5, 20 → buckets 0, 1, 2-4, 5-19, 20 or more)"""


@dataclass(frozen=True)
class EvaluationConfig:
    """Every model × every dataset: what to evaluate, with which limits and resources."""

    datasets: tuple[str, ...] = ()
    """partitions of ``eval_sets`` to evaluate (missing ones are skipped: benchmarks are optional)"""
    extra_files: Mapping[str, str] = field(default_factory=dict)
    """more evaluation sets, name → jsonl path"""
    max_samples: int | None = None
    """evaluate at most this many questions per dataset (file order)"""
    prompt_template: str | None = None
    """template for models that name none (``None``: ``prompt.template``)"""
    retrieval: RetrievalSettings = field(default_factory=RetrievalSettings)
    rollout: Mapping[str, Any] = field(default_factory=dict)
    """trajectory limits (:class:`spader_pipeline.agent.rollout.RolloutConfig`); a model may override them"""
    runner: RunnerSettings = field(default_factory=RunnerSettings)
    long_tail: LongTailSettings = field(default_factory=LongTailSettings)
    trained_models: Mapping[str, Any] = field(default_factory=lambda: {"kind": "hf"})
    """how the models from the catalog (base model, warm start, trained methods) are evaluated: a
    model entry without name and path (kind, batch_size, sampling, rollout, ...)"""
    catalog_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """per catalog model (``base``, ``warm_start``, a method), settings merged over ``trained_models``
    (mappings such as ``rollout`` and ``sampling`` key by key), e.g. shorter limits for the base model"""
    models: tuple[ModelSpec, ...] = ()
    """models configured by hand: the scripted baseline, endpoints, extra local folders"""

    def catalog_settings(self, name: str) -> dict[str, Any]:
        """``trained_models`` with ``catalog_overrides[name]`` merged in (one level into mappings)."""
        out = dict(self.trained_models)
        for key, value in (self.catalog_overrides.get(name) or {}).items():
            out[key] = {**out[key], **value} if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
        return out

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | None) -> EvaluationConfig:
        values = dict(params or {})
        values["retrieval"] = retrieval_settings(values.get("retrieval"), where="evaluate.retrieval")
        values["runner"] = from_mapping(RunnerSettings, values.get("runner"), where="evaluate.runner")
        long_tail = dict(values.get("long_tail") or {})
        if "edges" in long_tail:
            long_tail["edges"] = tuple(long_tail["edges"])
        values["long_tail"] = from_mapping(LongTailSettings, long_tail, where="evaluate.long_tail")
        values["datasets"] = tuple(values.get("datasets") or ())
        values["extra_files"] = dict(values.get("extra_files") or {})
        values["rollout"] = dict(values.get("rollout") or {})
        trained = dict(values.get("trained_models") or {"kind": "hf"})
        if {"name", "path"} & set(trained):
            raise ValueError("evaluate.trained_models: name and path come from the catalog manifests; remove them")
        values["trained_models"] = trained
        overrides = {str(k): dict(v or {}) for k, v in (values.get("catalog_overrides") or {}).items()}
        for name, override in overrides.items():
            if {"name", "path"} & set(override):
                raise ValueError(f"evaluate.catalog_overrides.{name}: name and path come from the catalog manifest")
        values["catalog_overrides"] = overrides
        values["models"] = tuple(ModelSpec.from_mapping(m) for m in values.get("models") or ())
        return from_mapping(cls, values, where="evaluate")
