"""The warm start before RL (either backend): demonstrations, supervised fine-tuning of the base
model on them (:func:`spader_pipeline.modeling.warm_start.train_sft`), and a greedy protocol check.

Demonstrations are the scripted policy's trajectories on training questions, or the user's own chat
conversations (``data_path``: JSON lines with ``messages``). Settings: the ``warm_start`` block of
``conf/base/parameters_training.yml`` (docs/training.md), typed once as :class:`WarmStartSettings`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline.agent.engines import DEFAULT_ENGINE, check_engine
from spader_pipeline.agent.scripted import ScriptedPolicy
from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.modeling.warm_start import WarmStartConfig
from spader_pipeline.retrieval.settings import RetrievalSettings, retrieval_settings
from spader_pipeline.typed_config import SettingsError, from_mapping, typed_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartSettings:
    """The ``warm_start`` block: what the warm start fine-tunes on, how, and where it writes."""

    enabled: bool = True
    """false: RL starts from the base model unchanged"""
    subprocess: bool = True
    """run in a child process, which returns its memory when it ends"""
    device: str = "auto"
    """where the SFT and its protocol check run (``auto``: CUDA when present, else the CPU)"""
    data_path: str | None = None
    """the user's own SFT data (JSON lines with ``messages``); ``None``: scripted demonstrations"""
    output_dir: str = "data/06_models/warm_start"
    """where the fine-tuned model is written"""
    prompt_template: str | None = None
    """a prompt template's name; ``None``: ``prompt.template``"""
    seed: int = 0
    """which training questions the demonstrations use"""
    max_demonstrations: int | None = None
    """scripted demonstrations on a seeded subset of at most this many questions; ``None``: all"""
    scripted: Mapping[str, Any] = field(default_factory=dict)
    """the scripted policy's settings (:class:`~spader_pipeline.agent.scripted.ScriptedPolicy`'s arguments)"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """the demonstrations' trajectory limits (``training.rollout`` in the YAML)"""
    search: RetrievalSettings = field(default_factory=RetrievalSettings)
    """what the demonstrations and the protocol check search with"""
    max_length: int | None = None
    """tokens per demonstration at most"""
    sft: WarmStartConfig = field(default_factory=WarmStartConfig)
    """the fine-tuning's settings"""
    check_questions: int = 0
    """greedy protocol check on this many validation questions after training (0: none)"""
    check_max_new_tokens: int = 64
    """tokens per turn of the protocol check"""
    engine: str = DEFAULT_ENGINE
    """the rollout engine of the protocol check (:mod:`spader_pipeline.agent.engines`)"""

    def __post_init__(self) -> None:
        check_engine(self.engine)  # an unknown engine: the error lists the registered ones

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | WarmStartSettings | None) -> WarmStartSettings:
        """The ``warm_start`` block typed: an unknown key or a value of the wrong kind names its full
        path (``warm_start.sft.max_stepz``) and what the block takes."""
        if isinstance(params, WarmStartSettings):
            return params
        values = dict(params or {})
        blocks = {
            "rollout": lambda v: from_mapping(RolloutConfig, v, where="warm_start.rollout", check_types=True),
            "search": lambda v: retrieval_settings(v, where="warm_start.search"),
            "sft": lambda v: from_mapping(WarmStartConfig, v, where="warm_start.sft", check_types=True),
            "scripted": _scripted_settings,
        }
        for key, build in blocks.items():
            if key in values:
                values[key] = typed_block(f"warm_start.{key}", lambda build=build, v=values[key]: build(v))
        return from_mapping(cls, values, where="warm_start", check_types=True)

    def replace(self, **changes: Any) -> WarmStartSettings:
        """A copy with ``changes`` (the portable run's own folder, device and search)."""
        return dataclasses.replace(self, **changes)


def _scripted_settings(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """``warm_start.scripted`` checked against the scripted policy's arguments (and its own checks)."""
    known = sorted(inspect.signature(ScriptedPolicy).parameters)
    unknown = sorted(set(values or {}) - set(known))
    if unknown:
        paths = ", ".join(f"warm_start.scripted.{key}" for key in unknown)
        raise SettingsError(f"unknown warm_start.scripted settings {unknown} ({paths}); known: {known}")
    ScriptedPolicy(**dict(values or {}))
    return dict(values or {})


def demonstrations(verl_train: pd.DataFrame, settings: WarmStartSettings, search: Any,
                   template: str) -> tuple[list[list[dict]], str]:
    """The conversations to fine-tune on and where they come from (``scripted`` or the file, which
    needs no ``search``)."""
    from spader_pipeline.agent.rollout import run_rollouts_sync

    if settings.data_path:
        lines = Path(settings.data_path).read_text().splitlines()
        return [json.loads(line)["messages"] for line in lines if line.strip()], str(settings.data_path)
    samples = samples_from_verl(verl_train, settings.max_demonstrations, settings.seed)
    demos = run_rollouts_sync(samples, ScriptedPolicy(**settings.scripted), search, settings.rollout, template)
    return [t.messages for t in demos if t.predicted is not None], "scripted"


def protocol_check(model, tokenizer, frame: pd.DataFrame | None, search: Any, settings: WarmStartSettings,
                   template: str) -> dict[str, float]:
    """Greedy rollouts of the warm-started model on ``check_questions`` validation questions: does
    it speak the protocol (valid turns, an answer) and how much does it recall?"""
    from spader_pipeline.agent.engines import build_generator
    from spader_pipeline.agent.rollout import run_rollouts_sync
    from spader_pipeline.agent.types import SamplingParams
    from spader_pipeline.algorithms import score_answers

    n = settings.check_questions
    if n <= 0 or frame is None or len(frame) == 0:
        return {}
    samples = samples_from_verl(frame, n, seed=1)
    gen = build_generator(settings.engine, model, tokenizer,
                          SamplingParams(temperature=0.0, max_new_tokens=settings.check_max_new_tokens))
    trajs = run_rollouts_sync(samples, gen, search, settings.rollout, template)
    turns = [s for t in trajs for s in t.steps]
    recall = [score_answers(list(t.predicted or ()), s["ground_truth"]).recall for t, s in zip(trajs, samples, strict=True)]
    return {
        "check/valid_turn_rate": sum(s.kind != "invalid" for s in turns) / max(len(turns), 1),
        "check/answered_rate": sum(t.predicted is not None for t in trajs) / len(trajs),
        "check/answer_recall": float(np.mean(recall)),
    }


def warm_start(base_path: str, verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None, search: Any,
               settings: WarmStartSettings, template: str,
               on_log: Callable[[int, Mapping[str, float]], None] | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Fine-tune the model at ``base_path`` on demonstrations into ``settings.output_dir``; returns its
    manifest and summary metrics (SFT summary, demonstration count, protocol check, seconds).
    ``search``: the open search backend the scripted demonstrations and the protocol check use
    (``settings.search`` over the index, :mod:`spader_pipeline.native.stages`); ``settings.device``
    places the model (``auto``, the default: CUDA when present, else the CPU)."""
    from spader_pipeline.agent.tokens import examples_from_dialogues
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.modeling.device import resolve_device
    from spader_pipeline.modeling.warm_start import train_sft

    started = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(base_path, device=resolve_device(settings.device))
    conversations, source = demonstrations(verl_train, settings, search, template)
    examples = examples_from_dialogues(tokenizer, conversations, model_type=model.config.model_type,
                                       max_length=settings.max_length)
    logger.info("warm start on %d demonstrations (%s)", len(examples), source)
    summary = train_sft(model, examples, settings.sft, pad_id=tokenizer.pad_token_id, on_log=on_log)
    out = Path(settings.output_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    metrics = {**summary, "demonstrations": float(len(examples))}
    metrics.update(protocol_check(model, tokenizer, verl_validation, search, settings, template))
    metrics["total_seconds"] = time.perf_counter() - started
    manifest = {"path": str(out.resolve()), "source": "warm_start", "base": base_path, "demonstrations": source,
                "warm_start": True, "device": str(next(model.parameters()).device)}
    return manifest, metrics
