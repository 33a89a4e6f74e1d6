"""The native trainer's validation pass: the current policy, greedy, on the fixed validation subset.

Settings, schedule and metric names are shared with the verl backend
(:mod:`spader_pipeline.algorithms.validation`, docs/metrics.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spader_pipeline.agent.engines import DEFAULT_ENGINE, build_generator
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.algorithms import score_answers
from spader_pipeline.algorithms.validation import validation_batches, validation_metrics
from spader_pipeline.native.checkpoint import weights_stamp

__all__ = ["greedy_trajectories", "validate_model_at", "validate_policy", "validation_identity", "weights_stamp"]


def greedy_trajectories(
    model: Any, tokenizer: Any, samples: Sequence[Mapping[str, Any]], search: Any, rollout: RolloutConfig,
    prompt_template: str, *, max_new_tokens: int, max_prompt_tokens: int, bf16: bool | str = False,
    batch_size: int | Mapping[str, int] | None = None, engine: str = DEFAULT_ENGINE,
) -> list[Any]:
    """One greedy trajectory of ``model`` per sample, in the samples' order, decoded by the rollout
    ``engine`` in the batches of :func:`~spader_pipeline.algorithms.validation.validation_batches`
    (``batch_size``: ``None``, one batch; an int or ``{data_source: n}``, batches of their own, each a
    rollout of its own)."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    samples = list(samples)
    trajectories: list[Any] = [None] * len(samples)
    for batch in validation_batches([_source(s) for s in samples], batch_size):
        generator = build_generator(engine, model, tokenizer, sampling, max_prompt_tokens=max_prompt_tokens,
                                    micro_batch_size=len(batch), bf16=bf16)
        done = run_rollouts_sync([samples[i] for i in batch], generator, search, rollout, prompt_template)
        for i, trajectory in zip(batch, done, strict=True):
            trajectories[i] = trajectory
    return trajectories


def validate_policy(
    model: Any, tokenizer: Any, samples: Sequence[Mapping[str, Any]], search: Any, rollout: RolloutConfig,
    prompt_template: str, *, max_new_tokens: int, max_prompt_tokens: int, bf16: bool | str = False,
    batch_size: int | Mapping[str, int] | None = None, engine: str = DEFAULT_ENGINE,
) -> dict[str, float]:
    """:func:`greedy_trajectories` of ``model`` on ``samples``, scored as ``val/<source>/…``."""
    trajectories = greedy_trajectories(model, tokenizer, samples, search, rollout, prompt_template,
                                       max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, bf16=bf16,
                                       batch_size=batch_size, engine=engine)
    scores = [score_answers(list(t.predicted or ()), s["ground_truth"]) for t, s in zip(trajectories, samples, strict=True)]
    return validation_metrics(
        [_source(s) for s in samples],
        [x.recall for x in scores],
        [x.f1 for x in scores],
        [sum(step.kind == "search" for step in t.steps) for t in trajectories],
    )


def _source(sample: Mapping[str, Any]) -> str:
    return str(sample.get("data_source") or "unknown")


def validation_identity(model_path: str | Path, samples: Sequence[Mapping[str, Any]], rollout: RolloutConfig,
                        prompt_template: str, *, max_new_tokens: int, max_prompt_tokens: int,
                        bf16: bool | str, batch_size: int | Mapping[str, int] | None = None,
                        engine: str = DEFAULT_ENGINE) -> dict[str, Any]:
    """What determines a greedy validation of the model at ``model_path``: its weights (name, size,
    mtime), the questions, the turn limits, the prompt, the precision, the batching and the rollout engine.
    Two methods starting from the same warm start share their step-0 validation when these are equal."""
    return json.loads(json.dumps({  # as stored in the catalog's JSON (tuples become lists)
        "model": str(Path(model_path).resolve()),
        "weights": weights_stamp(model_path),
        "questions": [str(s.get("id")) for s in samples],
        "rollout": {k: v for k, v in asdict(rollout).items()},
        "prompt_sha256": hashlib.sha256(prompt_template.encode()).hexdigest(),
        "max_new_tokens": int(max_new_tokens),
        "max_prompt_tokens": int(max_prompt_tokens),
        "bf16": bool(bf16),
        # only when set: an identity stored before the setting existed (one batch) still matches
        **({} if batch_size is None else {"batch_size": dict(batch_size) if isinstance(batch_size, Mapping)
                                          else int(batch_size)}),
        **({} if engine == DEFAULT_ENGINE else {"engine": engine}),  # the default: as before the setting
    }, default=str))


def validate_model_at(model_path: str | Path, samples: Sequence[Mapping[str, Any]], search: Any, config: Any,
                      prompt_template: str, *, batch_size: int | Mapping[str, int] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """``(metrics, identity)`` of the model at ``model_path``, greedy on ``samples`` with the trainer
    settings ``config`` (a :class:`~spader_pipeline.native.NativeTrainerConfig`: turn limits, device,
    precision) in batches of ``batch_size`` questions: the step-0 validation every method of one start
    model shares."""
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.modeling.device import resolve_device
    from spader_pipeline.modeling.precision import resolve_bf16

    device = resolve_device(config.device)
    model, tokenizer = load_model_and_tokenizer(model_path, device=device)
    bf16 = resolve_bf16(config.bf16, device, model)
    limits = {"max_new_tokens": config.max_new_tokens, "max_prompt_tokens": config.max_prompt_tokens,
              "batch_size": batch_size, "engine": config.engine}
    metrics = validate_policy(model.eval(), tokenizer, samples, search, config.rollout, prompt_template, bf16=bf16,
                              **limits)
    identity = validation_identity(model_path, samples, config.rollout, prompt_template, bf16=bf16, **limits)
    return metrics, identity
