"""Which models an evaluation runs, and how each becomes a generator.

A :class:`ModelSpec` is either configured in ``evaluate.models`` (the scripted baseline, a local
folder, an OpenAI-compatible endpoint, a checkpoint to serve) or comes from the catalog — the
manifest of the base model, the warm start or a trained method (:meth:`ModelSpec.from_manifest`),
which also carries the link to the MLflow training run that produced the checkpoint.

A model that is configured (``enabled``, the default) but cannot run here is an error
(:class:`ModelUnavailableError`), never a silent skip: a report missing its SPADER row would look
like a finished evaluation. ``enabled: false`` switches an entry off explicitly.

:func:`open_generator` turns a spec into a generator: ``scripted``, ``hf`` (in process, by the rollout
engine its ``engine`` names, :mod:`spader_pipeline.agent.engines`), ``openai`` (an external endpoint) or
``served`` (this process starts vLLM/SGLang on a merged checkpoint, GPU only).
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from spader_pipeline.agent.engines import DEFAULT_ENGINE, build_generator, check_engine
from spader_pipeline.agent.types import Generator, SamplingParams
from spader_pipeline.typed_config import from_mapping


class ModelUnavailableError(RuntimeError):
    """A configured evaluation model cannot be evaluated here (missing checkpoint, no endpoint, no GPU)."""


MODEL_KINDS = ("scripted", "hf", "openai", "served")
#: options of the OpenAI-compatible client (``openai`` and ``served`` models)
CLIENT_OPTIONS = ("max_retries", "backoff", "timeout", "api_key", "extra_body")
#: the engine of a kind's entries that name none (``engine``)
KIND_ENGINES = {"hf": DEFAULT_ENGINE, "served": "vllm"}
#: options a model entry may add, by kind: what :func:`open_generator` hands to its generator
KIND_OPTIONS: dict[str, tuple[str, ...]] = {
    "scripted": ("follow_up", "min_overlap", "query_style", "seed", "max_searches"),
    "hf": ("device", "bf16", "max_prompt_tokens", "chat_template_kwargs", "kv_cache_budget_mb"),
    "openai": CLIENT_OPTIONS,
    "served": (*CLIENT_OPTIONS, "server_args"),
}


@dataclass(frozen=True)
class ModelSpec:
    """One model entry of ``evaluate.models`` (see ``conf/base/parameters_evaluate.yml``)."""

    name: str
    kind: str
    path: str | None = None
    base_url: str | None = None
    model: str | None = None
    engine: str | None = None
    """what decodes: ``hf``, a rollout engine of :mod:`spader_pipeline.agent.engines` (default ``hf``);
    ``served``, the server (``vllm``, the default, or ``sglang``); ``None``: the kind's default"""
    prompt_template: str | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    rollout: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 1
    concurrency: int = 8
    options: Mapping[str, Any] = field(default_factory=dict)
    """the kind's own settings (:data:`KIND_OPTIONS`), written flat in the entry"""
    enabled: bool = True
    """``false``: the entry is switched off (skipped with a log line); every enabled entry must run"""
    source: str | None = None
    """the catalog dataset the model came from (``None``: configured in ``evaluate.models``)"""
    training_link: Mapping[str, str] = field(default_factory=dict)
    """MLflow tags linking to the training run of the checkpoint (:func:`spader_pipeline.tracking.training_link_tags`)"""

    def __post_init__(self) -> None:
        if self.engine is None:
            object.__setattr__(self, "engine", KIND_ENGINES.get(self.kind))
        if self.kind == "hf":
            check_engine(self.engine)  # unknown engines: the error lists the registered ones

    @classmethod
    def from_mapping(cls, entry: Mapping[str, Any]) -> ModelSpec:
        """A model entry: the fields above plus the options of its kind (:data:`KIND_OPTIONS`), flat;
        any other key is an error (:func:`~spader_pipeline.typed_config.from_mapping`)."""
        entry = dict(entry)
        kind = entry.get("kind")
        if kind not in MODEL_KINDS:
            raise ValueError(f"model {entry.get('name')!r}: kind must be one of {MODEL_KINDS}, got {kind!r}")
        options = {k: entry.pop(k) for k in KIND_OPTIONS[kind] if k in entry}
        where = f"evaluate model {entry.get('name')!r} (kind {kind}, options {', '.join(KIND_OPTIONS[kind])})"
        return from_mapping(cls, entry, where=where, exclude=("source", "training_link"), options=options)

    @classmethod
    def from_manifest(
        cls, name: str, manifest: Mapping[str, Any], settings: Mapping[str, Any], *, source: str,
        training_link: Mapping[str, str] | None = None,
    ) -> ModelSpec:
        """The model of a catalog manifest (``{"path", ...}``), evaluated with ``settings``
        (``evaluate.trained_models``: kind, batch size, decoding, rollout limits); ``training_link``:
        the tags linking it to its MLflow training run."""
        if not manifest.get("path"):
            raise ModelUnavailableError(
                f"model {name} ({source}): the manifest has no Hugging Face folder (a VERL checkpoint is "
                "converted by the merge pipeline: kedro run --pipeline merge)"
            )
        spec = cls.from_mapping({"kind": "hf", **settings, "name": name, "path": str(manifest["path"])})
        return replace(spec, source=source, training_link=dict(training_link or {}))

    def require_available(self) -> None:
        """Raise :class:`ModelUnavailableError` when this model cannot be evaluated here."""
        reason = self.unavailable_reason()
        if reason:
            origin = f" (from {self.source})" if self.source else " (evaluate.models)"
            raise ModelUnavailableError(
                f"evaluate: model {self.name}{origin} is configured but unavailable: {reason}. "
                "Build or train it first, fix the entry, or set enabled: false."
            )

    def unavailable_reason(self) -> str | None:
        """Why this model cannot be evaluated here (``None`` when it can)."""
        if self.kind in ("hf", "served"):
            if not self.path or not (Path(self.path) / "config.json").is_file():
                return f"no Hugging Face checkpoint at {self.path!r} (not built or trained yet)"
        if self.kind == "openai" and not (self.base_url and self.model):
            return "no base_url/model configured for the OpenAI-compatible endpoint"
        if self.kind == "served":
            import torch

            if not torch.cuda.is_available():
                return "serving a checkpoint with vLLM/SGLang needs a GPU"
            if self.engine == "vllm" and shutil.which("vllm") is None:
                return "the vllm executable is not installed"
            if self.engine == "sglang" and importlib.util.find_spec("sglang") is None:
                return "sglang is not installed"
        return None

    def checkpoint_identity(self) -> list[tuple[str, int, int]]:
        """``(file, size, mtime_ns)`` of a local checkpoint's weight files (empty for endpoints).

        Part of the resume key: a model retrained into the same folder must not reuse the cached
        results of its previous weights.
        """
        if self.kind not in ("hf", "served") or not self.path or not Path(self.path).is_dir():
            return []
        weights = sorted(
            p for p in Path(self.path).iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()
        )
        return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]

    def describe(self) -> dict[str, Any]:
        """Parameters logged with the evaluation (model, decoding)."""
        out = {"model": self.name, "kind": self.kind, "path": self.path, "endpoint_model": self.model}
        out.update({f"sampling.{k}": v for k, v in self.sampling.items()})
        out.update({f"rollout.{k}": v for k, v in self.rollout.items()})
        out.update({f"option.{k}": v for k, v in self.options.items()})
        return {k: v for k, v in out.items() if v is not None}


@contextlib.contextmanager
def open_generator(spec: ModelSpec) -> Iterator[Generator]:
    """The generator for ``spec`` (servers started here are stopped on exit)."""
    sampling = SamplingParams.from_mapping(spec.sampling)
    if spec.kind == "scripted":
        from spader_pipeline.agent.scripted import ScriptedPolicy

        yield ScriptedPolicy(**spec.options)
    elif spec.kind == "hf":
        from spader_pipeline.modeling.base_model import load_model_and_tokenizer
        from spader_pipeline.modeling.device import resolve_device
        from spader_pipeline.modeling.precision import resolve_bf16

        device = resolve_device(spec.options.get("device"))
        model, tokenizer = load_model_and_tokenizer(spec.path, device=device)
        # bf16 autocast as validation decides it (auto: on a GPU or a CPU with bf16 units), so the
        # held-out score and the validation curve measure a policy the same way
        bf16 = resolve_bf16(spec.options.get("bf16", False), device, model)
        kwargs = {k: v for k, v in spec.options.items() if k not in ("device", "bf16", "kv_cache_budget_mb")}
        yield build_generator(spec, model, tokenizer, sampling, micro_batch_size=max(1, spec.batch_size), bf16=bf16,
                              **kwargs)
    elif spec.kind == "openai":
        from spader_pipeline.agent.openai_backend import OpenAIChatGenerator

        yield OpenAIChatGenerator(
            spec.base_url, spec.model, sampling, concurrency=spec.concurrency, **_client_options(spec)
        )
    elif spec.kind == "served":
        from spader_pipeline.agent.openai_backend import OpenAIChatGenerator, served_model

        extra = [str(a) for a in spec.options.get("server_args", [])]
        with served_model(spec.path, engine=spec.engine, served_name=spec.name, extra_args=extra) as url:
            yield OpenAIChatGenerator(
                url, spec.name, sampling, concurrency=spec.concurrency, **_client_options(spec)
            )
    else:  # pragma: no cover - ModelSpec validates kinds
        raise ValueError(spec.kind)


def _client_options(spec: ModelSpec) -> dict[str, Any]:
    return {k: spec.options[k] for k in CLIENT_OPTIONS if k in spec.options}
