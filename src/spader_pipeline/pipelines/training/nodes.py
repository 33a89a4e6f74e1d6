"""Nodes of the training stage. Thin: the work is in :mod:`spader_pipeline.modeling`,
:mod:`spader_pipeline.native` and :mod:`spader_pipeline.launch`."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.algorithms.validation import ValidationSettings, validation_subset
from spader_pipeline.data.schema import SampleRecord, sample_record
from spader_pipeline.retrieval.settings import search_backend
from spader_pipeline.tracking_buffer import active_run_writer
from spader_pipeline.typed_config import from_mapping, method_settings

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def samples_from_verl(frame: pd.DataFrame, limit: int | None = None, seed: int = 0) -> list[SampleRecord]:
    """Training questions (:func:`~spader_pipeline.data.schema.sample_record`) from the VERL parquet
    (``extra_info.question``, ``reward_model.ground_truth``); an optional seeded subset of ``limit``."""
    rows: list[SampleRecord] = []
    for row in frame.to_dict(orient="records"):
        extra, reward = row.get("extra_info") or {}, row.get("reward_model") or {}
        rows.append(sample_record({"id": extra.get("id", len(rows)), "question": extra["question"],
                                   "ground_truth": reward.get("ground_truth", []), "data_source": row.get("data_source")}))
    if limit and len(rows) > limit:
        keep = np.random.default_rng(seed).choice(len(rows), size=int(limit), replace=False)
        rows = [rows[int(i)] for i in sorted(keep)]
    return rows


def _template(prompt: Mapping[str, Any], name: str | None = None) -> str:
    if name:
        return resolve_template({**prompt, "template": name})
    return resolve_template(prompt)


# ----------------------------------------------------------------------------------------------
# Warm start
# ----------------------------------------------------------------------------------------------


def warm_start(
    base_model_manifest: Mapping[str, Any],
    verl_train: pd.DataFrame,
    verl_validation: pd.DataFrame,
    index_manifest: Mapping[str, Any],
    params: Mapping[str, Any],
    prompt: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, float]]:
    """Supervised warm start of the base model; returns its manifest and summary metrics.

    Demonstrations are the scripted policy's trajectories on training questions, or the user's own
    chat conversations (``params.data_path``: JSON lines with ``messages``). ``enabled: false``
    passes the base model through unchanged.
    """
    from spader_pipeline.agent.rollout import RolloutConfig, run_rollouts_sync
    from spader_pipeline.agent.scripted import ScriptedPolicy
    from spader_pipeline.agent.tokens import examples_from_dialogues
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.modeling.warm_start import WarmStartConfig, train_sft

    if not params.get("enabled", True):
        logger.info("warm start disabled; RL starts from the base model")
        return {**base_model_manifest, "warm_start": False}, {}
    fingerprint = _fingerprint(base_model_manifest["path"], verl_train, params, prompt)
    done = Path(params["output_dir"]) / WARM_START_DONE
    if params.get("reuse", False) and done.is_file():
        previous = json.loads(done.read_text())
        if previous.get("fingerprint") == fingerprint:
            logger.info("warm start reused: %s was trained with the same settings and data", params["output_dir"])
            return previous["manifest"], previous["metrics"]
    started = time.perf_counter()
    seed = int(params.get("seed", 0))
    template = _template(prompt, params.get("prompt_template"))
    rollout_cfg = RolloutConfig.from_mapping(params.get("rollout", {}))
    model, tokenizer = load_model_and_tokenizer(base_model_manifest["path"])

    if params.get("data_path"):
        conversations = [json.loads(line)["messages"] for line in Path(params["data_path"]).read_text().splitlines() if line.strip()]
        source = str(params["data_path"])
    else:
        samples = samples_from_verl(verl_train, params.get("max_demonstrations"), seed)
        with search_backend(params.get("search"), index_manifest["index_dir"], where="warm_start.search") as search:
            demos = run_rollouts_sync(samples, ScriptedPolicy(**params.get("scripted", {})), search, rollout_cfg, template)
        conversations = [t.messages for t in demos if t.predicted is not None]
        source = "scripted"
    examples = examples_from_dialogues(tokenizer, conversations, model_type=model.config.model_type,
                                       max_length=params.get("max_length"))
    logger.info("warm start on %d demonstrations (%s)", len(examples), source)
    summary = train_sft(
        model, examples, from_mapping(WarmStartConfig, params.get("sft"), where="warm_start.sft"), pad_id=tokenizer.pad_token_id,
        on_log=lambda step, m: tracking.log_metrics(m, step=step, prefix="warm_start/train"),
    )
    out = Path(params["output_dir"])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    metrics = {**summary, "demonstrations": float(len(examples))}
    metrics.update(_protocol_check(model, tokenizer, verl_validation, index_manifest, params, template))
    metrics["total_seconds"] = time.perf_counter() - started
    manifest = {"path": str(out.resolve()), "source": "warm_start", "base": base_model_manifest["path"],
                "demonstrations": source, "warm_start": True}
    done.write_text(json.dumps({"fingerprint": fingerprint, "manifest": manifest, "metrics": metrics}, indent=1))
    return manifest, metrics


WARM_START_DONE = "warm_start_done.json"
"""Written beside a finished warm start: its settings' fingerprint, manifest and metrics (``reuse``)."""


def _fingerprint(base_path: str, verl_train: pd.DataFrame, params: Mapping[str, Any], prompt: Mapping[str, Any]) -> str:
    """Hash of what determines a warm start: base model, training questions, settings, prompt."""
    data = hashlib.sha256(pd.util.hash_pandas_object(verl_train.astype(str), index=False).values.tobytes()).hexdigest()
    settings = {k: v for k, v in params.items() if k not in ("reuse", "check_questions", "check_max_new_tokens")}
    own = Path(params["data_path"]).read_bytes() if params.get("data_path") else b""
    blob = json.dumps([str(base_path), data, hashlib.sha256(own).hexdigest(), settings, prompt], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _protocol_check(model, tokenizer, frame, index_manifest, params, template) -> dict[str, float]:
    """Greedy rollouts of the warm-started model on a few validation questions: does it speak the protocol?"""
    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.rollout import RolloutConfig, SamplingParams, run_rollouts_sync
    from spader_pipeline.algorithms import score_answers

    n = int(params.get("check_questions", 0) or 0)
    if n <= 0 or frame is None or len(frame) == 0:
        return {}
    samples = samples_from_verl(frame, n, seed=1)
    gen = HFGenerator(model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=int(params.get("check_max_new_tokens", 64))))
    with search_backend(params.get("search"), index_manifest["index_dir"], where="warm_start.search") as search:
        trajs = run_rollouts_sync(samples, gen, search, RolloutConfig.from_mapping(params.get("rollout", {})), template)
    turns = [s for t in trajs for s in t.steps]
    recall = [score_answers(list(t.predicted or ()), s["ground_truth"]).recall for t, s in zip(trajs, samples, strict=True)]
    return {
        "check/valid_turn_rate": sum(s.kind != "invalid" for s in turns) / max(len(turns), 1),
        "check/answered_rate": sum(t.predicted is not None for t in trajs) / len(trajs),
        "check/answer_recall": float(np.mean(recall)),
    }


# ----------------------------------------------------------------------------------------------
# RL
# ----------------------------------------------------------------------------------------------


def method_run_identity(
    init_manifest: Mapping[str, Any], method: Mapping[str, Any], training: Mapping[str, Any]
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Name, tags and parameters of a method's MLflow run.

    The parameters are what defines the method — its ``train_<method>.method`` block over the shared
    reward settings — under namespace-free keys (``method``, ``reward.alpha``, ``options.gamma``…),
    so MLflow's compare view of two methods' runs shows exactly their differences.
    """
    name = method["method"]
    backend = training.get("backend", "native")
    seed = int(method_settings(training, method, "native").get("seed", 0))
    base = init_manifest.get("base") or init_manifest["path"]
    tags = {"method": name, "backend": backend, "base_model": Path(str(base)).name, "seed": seed,
            "init_model": init_manifest["path"]}
    params = {"backend": backend, "seed": seed, **method_settings(training, method)}
    return f"{name} seed{seed}", tags, params


def train_policy(
    init_manifest: Mapping[str, Any],
    verl_train: pd.DataFrame,
    index_manifest: Mapping[str, Any],
    method: Mapping[str, Any],
    training: Mapping[str, Any],
    prompt: Mapping[str, Any],
    verl_validation: pd.DataFrame | None = None,
    warm_start_validation: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, float]], dict[str, float]]:
    """Train one method from ``init_manifest``; return the policy manifest, the per-step history
    and final summary metrics. ``training.backend`` picks the native trainer or a VERL launch.

    With ``verl_validation`` the policy is validated on its fixed subset on ``training.validation``'s
    schedule (:mod:`spader_pipeline.algorithms.validation`): ``val/<source>/…`` per step, step 0 first
    (``warm_start_validation``'s, computed once for every method, when it scored the same start model).

    The training is one MLflow run of its own (:func:`spader_pipeline.tracking.method_run`) with the
    same metric keys for every method; VERL joins it through ``MLFLOW_RUN_ID``. The manifest
    records the run id (and the checkpoint's MLflow model id), which evaluation links back to.
    """
    backend = training.get("backend", "native")
    if backend not in ("native", "verl"):
        raise ValueError(f"training.backend={backend!r}: use native or verl")
    run_name, tags, params = method_run_identity(init_manifest, method, training)
    with tracking.method_run(run_name, tags, params) as run_id:
        manifest, history = _train(init_manifest, verl_train, index_manifest, method, training, prompt,
                                   verl_validation, warm_start_validation)
        manifest["mlflow_run_id"] = run_id
        if manifest.get("path"):
            manifest["mlflow_model_id"] = tracking.register_checkpoint(manifest["path"], name=method["method"],
                                                                       params=params)
        summary = _summary(history) if backend == "native" else {}
        tracking.log_metrics(summary)
    return manifest, history, summary


def _train(init_manifest, verl_train, index_manifest, method, training, prompt, verl_validation=None,
           warm_start_validation=None):
    """The training itself: (manifest, per-step history); metrics go to the active (method) run."""
    name = method["method"]
    run_dir = Path(training.get("output_dir", "data/06_models")) / f"train_{name}"
    template = _template(prompt, training.get("prompt_template"))
    if training.get("backend", "native") == "verl":
        from spader_pipeline.launch.verl import launch_verl_training

        return launch_verl_training(init_manifest, index_manifest, method, training, run_dir), []

    from spader_pipeline.native import NativeTrainerConfig, train_native

    config = NativeTrainerConfig.from_mapping(method_settings(training, method, "native"))
    samples = samples_from_verl(verl_train, training.get("max_train_questions"), config.seed)
    validation = samples_from_verl(verl_validation) if verl_validation is not None and len(verl_validation) else []
    # metrics and samples go through a buffered writer: no step waits on, or fails with, the server
    with (search_backend(training.get("search"), index_manifest["index_dir"], where="training.search") as search,
          active_run_writer() as writer):
        result = train_native(
            config,
            model_path=init_manifest["path"],
            samples=samples,
            search=search,
            run_dir=run_dir,
            prompt_template=template,
            log_metrics=(lambda m, step: writer.log_metrics(tracking.comparable_first(m), step)) if writer else None,
            log_artifact=(lambda p: writer.log_artifact(p, artifact_path="samples")) if writer else None,
            validation=validation,
            validation_settings=validation_settings(training),
            start_validation=warm_start_validation,
        )
    manifest = {"path": str(result.final_model_dir.resolve()), "method": name, "backend": "native",
                "steps": result.steps, "run_dir": str(run_dir.resolve()), "init": init_manifest["path"],
                "resumed_from": result.resumed_from}
    return manifest, result.history


def validate_warm_start(
    warm_start_manifest: Mapping[str, Any],
    verl_validation: pd.DataFrame,
    index_manifest: Mapping[str, Any],
    training: Mapping[str, Any],
    prompt: Mapping[str, Any],
) -> dict[str, Any]:
    """Step 0 of every method's validation curve, computed once: the start model, greedy, on the
    validation subset with the native trainer's turn limits (``{"identity", "metrics"}``; empty when
    the schedule has no step 0 or the backend is VERL, whose loop validates on its own)."""
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.modeling.device import resolve_device
    from spader_pipeline.modeling.precision import resolve_bf16
    from spader_pipeline.native import NativeTrainerConfig
    from spader_pipeline.native.validation import validate_policy, validation_identity

    settings = validation_settings(training)
    samples = validation_subset(samples_from_verl(verl_validation), settings.max_questions)
    if training.get("backend", "native") != "native" or not settings.before_train or not samples:
        return {}
    config = NativeTrainerConfig.from_mapping(dict(training.get("native") or {}))
    template = _template(prompt, training.get("prompt_template"))
    model, tokenizer = load_model_and_tokenizer(warm_start_manifest["path"], device=resolve_device(config.device))
    bf16 = resolve_bf16(config.bf16, resolve_device(config.device), model)
    with search_backend(training.get("search"), index_manifest["index_dir"], where="training.search") as search:
        metrics = validate_policy(model, tokenizer, samples, search, config.rollout, template,
                                  max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                                  bf16=bf16)
    identity = validation_identity(warm_start_manifest["path"], samples, config.rollout, template,
                                   max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                                   bf16=bf16)
    logger.info("warm start validation (step 0 of every method): %s",
                ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    return {"identity": identity, "metrics": metrics}


def validation_settings(training: Mapping[str, Any]) -> ValidationSettings:
    """``training.validation`` (shared by both backends) as :class:`ValidationSettings`."""
    return from_mapping(ValidationSettings, training.get("validation"), where="training.validation")


def _summary(history: list[dict[str, float]], window: int = 10) -> dict[str, float]:
    """Means of the last ``window`` steps (the run's end state) plus the step count."""
    if not history:
        return {"steps": 0.0}
    tail = history[-window:]
    keys = [k for k in tail[-1] if k != "step"]
    out = {f"last{window}/{k}": float(np.mean([h[k] for h in tail if k in h])) for k in keys}
    out["steps"] = float(history[-1]["step"])
    out["seconds"] = float(sum(h.get("perf/step_seconds", 0.0) for h in history))
    return out
