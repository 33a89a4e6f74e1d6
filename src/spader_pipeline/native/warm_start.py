"""The warm start before RL (either backend): demonstrations, supervised fine-tuning of the base
model on them (:func:`spader_pipeline.modeling.warm_start.train_sft`), and a greedy protocol check.

Demonstrations are the scripted policy's trajectories on training questions, or the user's own chat
conversations (``params.data_path``: JSON lines with ``messages``). Settings: the ``warm_start``
block of ``conf/base/parameters_training.yml`` (docs/training.md).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.typed_config import from_mapping

logger = logging.getLogger(__name__)


def demonstrations(verl_train: pd.DataFrame, params: Mapping[str, Any], search: Any,
                   template: str) -> tuple[list[list[dict]], str]:
    """The conversations to fine-tune on and where they come from (``scripted`` or the file, which
    needs no ``search``)."""
    from spader_pipeline.agent.rollout import RolloutConfig, run_rollouts_sync
    from spader_pipeline.agent.scripted import ScriptedPolicy

    if params.get("data_path"):
        lines = Path(params["data_path"]).read_text().splitlines()
        return [json.loads(line)["messages"] for line in lines if line.strip()], str(params["data_path"])
    samples = samples_from_verl(verl_train, params.get("max_demonstrations"), int(params.get("seed", 0)))
    rollout = RolloutConfig.from_mapping(params.get("rollout", {}))
    demos = run_rollouts_sync(samples, ScriptedPolicy(**params.get("scripted", {})), search, rollout, template)
    return [t.messages for t in demos if t.predicted is not None], "scripted"


def protocol_check(model, tokenizer, frame: pd.DataFrame | None, search: Any, params: Mapping[str, Any],
                   template: str) -> dict[str, float]:
    """Greedy rollouts of the warm-started model on ``check_questions`` validation questions: does
    it speak the protocol (valid turns, an answer) and how much does it recall?"""
    from spader_pipeline.agent.engines import DEFAULT_ENGINE, build_generator
    from spader_pipeline.agent.rollout import RolloutConfig, SamplingParams, run_rollouts_sync
    from spader_pipeline.algorithms import score_answers

    n = int(params.get("check_questions", 0) or 0)
    if n <= 0 or frame is None or len(frame) == 0:
        return {}
    samples = samples_from_verl(frame, n, seed=1)
    gen = build_generator(DEFAULT_ENGINE, model, tokenizer,
                          SamplingParams(temperature=0.0, max_new_tokens=int(params.get("check_max_new_tokens", 64))))
    trajs = run_rollouts_sync(samples, gen, search, RolloutConfig.from_mapping(params.get("rollout", {})), template)
    turns = [s for t in trajs for s in t.steps]
    recall = [score_answers(list(t.predicted or ()), s["ground_truth"]).recall for t, s in zip(trajs, samples, strict=True)]
    return {
        "check/valid_turn_rate": sum(s.kind != "invalid" for s in turns) / max(len(turns), 1),
        "check/answered_rate": sum(t.predicted is not None for t in trajs) / len(trajs),
        "check/answer_recall": float(np.mean(recall)),
    }


def warm_start(base_path: str, verl_train: pd.DataFrame, verl_validation: pd.DataFrame | None, search: Any,
               params: Mapping[str, Any], template: str,
               on_log: Callable[[int, Mapping[str, float]], None] | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Fine-tune the model at ``base_path`` on demonstrations into ``params.output_dir``; returns its
    manifest and summary metrics (SFT summary, demonstration count, protocol check, seconds).
    ``search``: the open search backend the scripted demonstrations and the protocol check use
    (``params.search`` over the index, :mod:`spader_pipeline.native.stages`); ``params.device``
    places the model (``auto``, the default: CUDA when present, else the CPU)."""
    from spader_pipeline.agent.tokens import examples_from_dialogues
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.modeling.device import resolve_device
    from spader_pipeline.modeling.warm_start import WarmStartConfig, train_sft

    started = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(base_path, device=resolve_device(params.get("device")))
    conversations, source = demonstrations(verl_train, params, search, template)
    examples = examples_from_dialogues(tokenizer, conversations, model_type=model.config.model_type,
                                       max_length=params.get("max_length"))
    logger.info("warm start on %d demonstrations (%s)", len(examples), source)
    summary = train_sft(model, examples, from_mapping(WarmStartConfig, params.get("sft"), where="warm_start.sft"),
                        pad_id=tokenizer.pad_token_id, on_log=on_log)
    out = Path(params["output_dir"])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    metrics = {**summary, "demonstrations": float(len(examples))}
    metrics.update(protocol_check(model, tokenizer, verl_validation, search, params, template))
    metrics["total_seconds"] = time.perf_counter() - started
    manifest = {"path": str(out.resolve()), "source": "warm_start", "base": base_path, "demonstrations": source,
                "warm_start": True, "device": str(next(model.parameters()).device)}
    return manifest, metrics
