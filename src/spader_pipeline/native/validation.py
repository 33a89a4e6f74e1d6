"""The native trainer's validation pass: the current policy on the fixed validation subset, greedy or sampled.

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

import numpy as np

from spader_pipeline.agent.engines import DEFAULT_ENGINE, build_generator
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.algorithms import score_answers
from spader_pipeline.algorithms.validation import ValidationSettings, validation_batches, validation_metrics
from spader_pipeline.native.checkpoint import weights_stamp

__all__ = ["greedy_trajectories", "sampled_trajectories", "validate_model_at", "validate_policy",
           "validation_identity", "weights_stamp"]

#: one greedy trajectory per question, in one batch
GREEDY = ValidationSettings()


def _plain(value: int | Mapping[str, int]) -> int | dict[str, int]:
    return dict(value) if isinstance(value, Mapping) else int(value)


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
    validation: ValidationSettings = GREEDY, temperature: float = 1.0, engine: str = DEFAULT_ENGINE,
) -> dict[str, float]:
    """``model`` scored on ``samples`` as ``val/<source>/…``: :func:`greedy_trajectories` of the greedy
    questions (in ``validation.batch_size``'s batches), :func:`sampled_trajectories` of the questions
    ``validation.trajectories`` samples (at ``validation.temperature``, else ``temperature``: the training's),
    each question's score the mean over its trajectories."""
    samples = list(samples)
    counts = [validation.trajectories_of(_source(s)) for s in samples]
    limits = {"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "bf16": bf16,
              "engine": engine}
    greedy = [i for i, n in enumerate(counts) if n == 1]
    per_question: list[list[Any]] = [[] for _ in samples]
    for i, trajectory in zip(greedy, greedy_trajectories(model, tokenizer, [samples[i] for i in greedy], search, rollout,
                                                         prompt_template, batch_size=validation.batch_size, **limits),
                             strict=True):
        per_question[i] = [trajectory]
    sampling_temperature = validation.sampling_temperature(temperature)
    for i, n in enumerate(counts):
        if n > 1:
            per_question[i] = sampled_trajectories(model, tokenizer, samples[i], n, search, rollout, prompt_template,
                                                   temperature=sampling_temperature, seed=validation.seed + i, **limits)
    scores = [[score_answers(list(t.predicted or ()), s["ground_truth"]) for t in trajectories]
              for trajectories, s in zip(per_question, samples, strict=True)]
    return validation_metrics(
        [_source(s) for s in samples],
        [float(np.mean([x.recall for x in question])) for question in scores],
        [float(np.mean([x.f1 for x in question])) for question in scores],
        [float(np.mean([sum(step.kind == "search" for step in t.steps) for t in trajectories]))
         for trajectories in per_question],
    )


def sampled_trajectories(
    model: Any, tokenizer: Any, sample: Mapping[str, Any], count: int, search: Any, rollout: RolloutConfig,
    prompt_template: str, *, temperature: float, seed: int, max_new_tokens: int, max_prompt_tokens: int,
    bf16: bool | str = False, engine: str = DEFAULT_ENGINE,
) -> list[Any]:
    """``count`` trajectories of ``model`` on one question, sampled at ``temperature``, decoded together from
    a generator seeded with ``seed`` (the same rows and random numbers for every policy scored so)."""
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    generator = build_generator(engine, model, tokenizer, sampling, max_prompt_tokens=max_prompt_tokens,
                                micro_batch_size=count, bf16=bf16)
    return run_rollouts_sync([sample] * count, generator, search, rollout, prompt_template)


def _source(sample: Mapping[str, Any]) -> str:
    return str(sample.get("data_source") or "unknown")


def validation_identity(model_path: str | Path, samples: Sequence[Mapping[str, Any]], rollout: RolloutConfig,
                        prompt_template: str, *, max_new_tokens: int, max_prompt_tokens: int,
                        bf16: bool | str, validation: ValidationSettings = GREEDY, temperature: float = 1.0,
                        engine: str = DEFAULT_ENGINE) -> dict[str, Any]:
    """What determines a validation of the model at ``model_path``: its weights (name, size,
    mtime), the questions, the turn limits, the prompt, the precision, the batching, the sampled trajectories
    (their count, temperature and seed) and the rollout engine.
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
        **({} if validation.batch_size is None else {"batch_size": _plain(validation.batch_size)}),
        **({"trajectories": _plain(validation.trajectories), "seed": validation.seed,
            "temperature": validation.sampling_temperature(temperature)} if validation.sampled else {}),
        **({} if engine == DEFAULT_ENGINE else {"engine": engine}),  # the default: as before the setting
    }, default=str))


def validate_model_at(model_path: str | Path, samples: Sequence[Mapping[str, Any]], search: Any, config: Any,
                      prompt_template: str, *, validation: ValidationSettings = GREEDY) -> tuple[dict[str, float], dict[str, Any]]:
    """``(metrics, identity)`` of the model at ``model_path`` on ``samples`` with the trainer settings
    ``config`` (a :class:`~spader_pipeline.native.NativeTrainerConfig`: turn limits, device, precision,
    sampling temperature) as ``validation`` decodes (batches, sampled trajectories): the step-0
    validation every method of one start model shares."""
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.modeling.device import resolve_device
    from spader_pipeline.modeling.precision import resolve_bf16

    device = resolve_device(config.device)
    model, tokenizer = load_model_and_tokenizer(model_path, device=device)
    bf16 = resolve_bf16(config.bf16, device, model)
    limits = {"max_new_tokens": config.max_new_tokens, "max_prompt_tokens": config.max_prompt_tokens,
              "validation": validation, "temperature": config.temperature, "engine": config.engine}
    metrics = validate_policy(model.eval(), tokenizer, samples, search, config.rollout, prompt_template, bf16=bf16,
                              **limits)
    identity = validation_identity(model_path, samples, config.rollout, prompt_template, bf16=bf16, **limits)
    return metrics, identity
