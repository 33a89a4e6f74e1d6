"""Native single-process RL trainer (CPU or one GPU), a loop you read top to bottom (CleanRL style).

One step::

    questions ──► n rollouts each (rollout engine, real search)  ─ collect_rollouts
      ──► rewards + advantages of the method (and GRPO's, for comparison)  ─ score
      ──► clipped PPO loss + KL to the reference, AdamW step (verl's core_algos)  ─ update_policy
      ──► metrics, samples, checkpoint  ─ record_step, checkpoint
      ──► greedy validation on a fixed validation subset (step 0 and every ``validation.every``)

The maths lives in :mod:`spader_pipeline.algorithms` (rewards, advantages) and
``verl.trainer.ppo.core_algos`` (losses); nothing is re-derived here. A killed run resumes from its
last checkpoint with the same questions, sampling seeds and optimiser state. Logged metrics:
docs/metrics.md.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spader_pipeline.agent.engines import build_generator, captures_states
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import CapturesStates, SamplingParams
from spader_pipeline.algorithms.group_metrics import comparison_advantages
from spader_pipeline.algorithms.validation import ValidationSettings, validation_subset
from spader_pipeline.host_memory import bound_heap
from spader_pipeline.modeling.base_model import load_model_and_tokenizer, train_top_layers
from spader_pipeline.modeling.boundary import first_trained_block, shares_frozen_blocks, supports_boundary
from spader_pipeline.modeling.device import resolve_device
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.native.batch import (
    ENGINE_COUNTERS,
    Advantages,
    RolloutBatch,
    Rollouts,
    build_batch,
    compute_advantages,
    questions_for_step,
)
from spader_pipeline.native.checkpoint import (
    checkpoint_to_resume,
    restore_trainer_state,
    run_settings,
    save_checkpoint,
    settings_fingerprint,
)
from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.native.metrics import host_memory_report, step_report
from spader_pipeline.native.records import append_history, read_history, write_history, write_samples
from spader_pipeline.native.update import actor_config, update_policy
from spader_pipeline.native.validation import validate_policy, validation_identity

logger = logging.getLogger(__name__)

MetricsLogger = Callable[[Mapping[str, float], int], None]
ArtifactLogger = Callable[[Path], None]


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    final_model_dir: Path
    steps: int
    history: list[dict[str, float]]
    resumed_from: int | None


@dataclass
class RunState:
    """Everything a run carries from step to step."""

    config: NativeTrainerConfig
    run_dir: Path
    settings: dict[str, Any]
    """what the run's checkpoints record and a resume must match (:func:`run_settings`)"""
    model: Any
    tokenizer: Any
    reference: Any
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    actor_cfg: Any
    bf16: bool | str
    history: list[dict[str, float]]
    start_step: int
    resumed_from: int | None
    boundary_block: int | None = None
    """first trained block when the update starts from the rollout's states (``reuse_rollout_states``)"""
    reference_shares_boundary: bool = False
    """the reference's frozen blocks equal the policy's: its pass starts from the same states"""
    rollout_model: Any = None
    """the bf16 copy the rollout decodes with (``rollout_weights: bf16``); ``None``: ``model`` itself"""

    @property
    def fingerprint(self) -> str:
        return settings_fingerprint(self.settings)


def train_native(
    config: NativeTrainerConfig,
    *,
    model_path: str | Path,
    samples: Sequence[Mapping[str, Any]],
    search: Any,
    run_dir: str | Path,
    prompt_template: str,
    log_metrics: MetricsLogger | None = None,
    log_artifact: ArtifactLogger | None = None,
    stop_after: int | None = None,
    validation: Sequence[Mapping[str, Any]] = (),
    validation_settings: ValidationSettings | None = None,
    start_validation: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Train the model at ``model_path`` with ``config.method``; write checkpoints and the final model.

    Args:
        samples: training questions, each ``{"id", "question", "ground_truth"}``.
        search: an async search backend (``RetrievalClient`` or ``retrieval.service.LocalSearch``).
        run_dir: output directory (checkpoints, ``final/``, ``metrics.jsonl``, ``samples/``).
        prompt_template: the prompt template text (``{question}`` placeholder).
        log_metrics / log_artifact: callbacks (e.g. MLflow); ``None`` = only local files.
        stop_after: end after this global step without finishing (tests of resume).
        validation: validation questions (same shape as ``samples``); with ``validation_settings``
            the policy is scored greedy on their fixed subset at step 0 and on its schedule
            (``val/<source>/…`` in the step's metrics; step 0 is a history row of its own).
        start_validation: ``{"identity", "metrics"}`` of the start model's validation computed once for
            every method (the ``validate_warm_start`` node); used as step 0 when its identity matches.
    """
    if not samples:
        raise ValueError("no training samples")
    run = start_run(config, model_path, Path(run_dir))
    settings = validation_settings or ValidationSettings(every=0, before_train=False)
    val_set = validation_subset(validation, settings.max_questions)

    def validate(step: int, last: bool = False) -> dict[str, float]:
        due = val_set and (settings.due(step, config.total_steps) or (last and settings.every > 0))
        return _validate(run, val_set, search, prompt_template, settings) if due else {}

    step, run_started, out_of_time, longest_step = run.start_step, time.perf_counter(), False, 0.0
    if step == 0 and val_set and settings.due(0, config.total_steps):
        identity = validation_identity(model_path, val_set, config.rollout, prompt_template,
                                       max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                                       bf16=run.bf16, validation=settings, temperature=config.temperature,
                                       engine=config.engine)
        shared = start_validation if start_validation and start_validation.get("identity") == identity else None
        record_validation(run, dict(shared["metrics"]) if shared else validate(0), log_metrics)
    while step < config.total_steps and not out_of_time:
        step += 1
        step_started = time.perf_counter()
        rollouts = collect_rollouts(run, samples, search, prompt_template, step)
        adv, grpo = score(config, rollouts.batch, step)
        update_started = time.perf_counter()
        run.model.train()
        update = update_policy(run.model, run.reference, run.optimizer, run.trainable, rollouts.batch, adv, config,
                               run.actor_cfg, bf16=run.bf16, step=step,
                               reference_shares_boundary=run.reference_shares_boundary)
        run.scheduler.step()
        run.model.eval()
        refresh_rollout_copy(run)
        timing = {"update": time.perf_counter() - update_started, "step_started": step_started}
        metrics = step_report(config, rollouts, adv, grpo, update, timing, lr=run.scheduler.get_last_lr()[0])
        metrics.update(host_memory_report())
        # With a budget, stop before a step that would not end within it (judged by the longest so far);
        # the last step is then validated, as the schedule's last one is.
        longest_step = max(longest_step, time.perf_counter() - step_started)
        out_of_time = (config.max_seconds is not None
                       and time.perf_counter() - run_started + longest_step > config.max_seconds)
        metrics.update(validate(step, last=out_of_time))
        record_step(run, step, metrics, rollouts, adv, log_metrics, log_artifact)
        checkpoint(run, step, out_of_time)
        if stop_after is not None and step >= stop_after:
            break
    return finish_run(run, step, out_of_time)


# ----------------------------------------------------------------------------------------------
# The phases of a run, in the order the loop calls them
# ----------------------------------------------------------------------------------------------


def start_run(config: NativeTrainerConfig, model_path: str | Path, run_dir: Path) -> RunState:
    """Seed, then load the policy (from the last checkpoint when resuming), its reference and optimiser.

    Checkpoints of other settings or another start model are never deleted: with ``resume`` the run
    stops with :class:`~spader_pipeline.native.checkpoint.SettingsChanged` naming each changed setting;
    without it, or when only the start model was written again, they move aside whole
    (``checkpoints.superseded-<time>/``, with the run's config and history).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    bound_heap()  # the steps' changing tensor shapes otherwise make glibc's heap creep (host_memory)
    settings = run_settings(config, model_path)
    resume = checkpoint_to_resume(config, settings, run_dir)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    model, tokenizer = load_model_and_tokenizer(resume[1] if resume else model_path, device=device)
    trainable = train_top_layers(model, config.trainable_layers)
    bf16 = resolve_bf16(config.bf16, device, model)
    reference = None
    if config.kl_coef > 0:  # the reference is always the model the run started from
        reference = model if not resume else load_model_and_tokenizer(model_path, device=device)[0]
        reference = copy.deepcopy(reference).eval().requires_grad_(False)
    # not fused: the fused step writes the weights without bumping their version counters, by which the
    # static decoding step knows to refresh its bf16 copies (modeling/graph_decode.py)
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, betas=config.betas,
                                  weight_decay=config.weight_decay, fused=False)
    warmup = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    run = RunState(config, run_dir, settings, model, tokenizer, reference, trainable, optimizer, scheduler,
                   actor_config(config), bf16, history=[], start_step=0, resumed_from=resume[0] if resume else None)
    run.boundary_block = _boundary_block(config, model)
    if config.rollout_weights == "bf16":
        run.rollout_model = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
    run.reference_shares_boundary = bool(
        reference is not None and run.boundary_block and shares_frozen_blocks(model, reference, run.boundary_block))
    if resume:
        run.start_step = restore_trainer_state(resume[1], optimizer, scheduler)
        run.history = [h for h in read_history(run_dir) if h["step"] <= run.start_step]
        logger.info("resuming %s from step %d (%s)", config.method, run.start_step, resume[1])
    write_history(run_dir, run.history)
    return run


def refresh_rollout_copy(run: RunState) -> None:
    """Bring the bf16 rollout copy up to the trained weights (only the trained parameters move)."""
    if run.rollout_model is None:
        return
    copies = dict(run.rollout_model.named_parameters())
    with torch.no_grad():
        for name, param in run.model.named_parameters():
            if param.requires_grad:
                copies[name].copy_(param)


def _boundary_block(config: NativeTrainerConfig, model: Any) -> int | None:
    """The first trained block when the update can start from the rollout's states, else ``None``."""
    first = first_trained_block(model, config.trainable_layers)
    if not config.reuse_rollout_states or first is None:
        return None
    if not captures_states(config.engine):
        logger.info("the %s rollout engine captures no states: the update runs the frozen blocks", config.engine)
        return None
    if not supports_boundary(model, first):
        logger.info("%s: the update runs the frozen blocks (no boundary states for this model)",
                    type(model).__name__)
        return None
    return first


def collect_rollouts(run: RunState, samples: Sequence[Mapping[str, Any]], search: Any, prompt_template: str,
                     step: int) -> Rollouts:
    """``prompts_per_step`` questions × ``group_size`` sampled trajectories each (one group per question)."""
    config = run.config
    questions = questions_for_step(samples, step, config.prompts_per_step, config.seed)
    group = [{**q, "uid": f"{step}-{k}"} for k, q in enumerate(questions) for _ in range(config.group_size)]
    sampling = SamplingParams(
        temperature=config.temperature, max_new_tokens=config.max_new_tokens, seed=config.seed * 100_003 + step
    )
    # A bf16 rollout copy decodes without autocast and captures no states (not the frozen blocks' own).
    policy = run.rollout_model if run.rollout_model is not None else run.model
    block = run.boundary_block if run.rollout_model is None else None
    # One decoding pass per `rows` trajectories (whole groups), each pass keeping its KV cache
    # between turns; the generator's captures stay in start order across passes.
    rows = config.rollout_rows(run.model.config)
    generator = build_generator(config, policy, run.tokenizer, sampling, max_prompt_tokens=config.max_prompt_tokens,
                                micro_batch_size=rows, bf16=run.bf16 and run.rollout_model is None,
                                capture_states_from_layer=block - 1 if block else None)
    started = time.perf_counter()
    trajectories = [trajectory for first in range(0, len(group), rows)
                    for trajectory in run_rollouts_sync(group[first : first + rows], generator, search,
                                                        config.rollout, prompt_template)]
    seconds = time.perf_counter() - started
    captured = generator.captured_states() if block and isinstance(generator, CapturesStates) else None
    batch = build_batch(trajectories, group, run.tokenizer.pad_token_id, captured=captured, boundary_block=block)
    # the engine's counters, where it keeps them (else the model tokens of the trajectories, and 0)
    capture = getattr(generator, "capture", None)
    tokens = getattr(generator, "generated_tokens", None)
    if tokens is None:
        tokens = sum(sum(t.response_mask or ()) for t in trajectories)
    counters = {name: getattr(generator, name, 0) for name in ENGINE_COUNTERS}
    return Rollouts(trajectories, batch, seconds, tokens, capture_seconds=capture.seconds if capture is not None else 0.0,
                    **counters)


def score(config: NativeTrainerConfig, batch: RolloutBatch, step: int) -> tuple[Advantages, torch.Tensor]:
    """The method's rewards and advantages (the global step drives the tool-cost schedule), and
    GRPO's advantages ``[B, R]`` on the same batch, for ``adv/*_vs_grpo`` (docs/metrics.md)."""
    adv = compute_advantages(batch, config.method, global_step=step, reward=config.reward, options=config.options)
    grpo = comparison_advantages(batch.response_mask, batch.uids, batch.rewards, global_step=step,
                                 reward=config.reward)
    return adv, grpo


def record_step(run: RunState, step: int, metrics: dict[str, float], rollouts: Rollouts, adv: Advantages,
                log_metrics: MetricsLogger | None, log_artifact: ArtifactLogger | None) -> None:
    """History line, metrics callback, samples file (every ``log_samples_every`` steps and step 1)."""
    config = run.config
    run.history.append({"step": step, **metrics})
    append_history(run.run_dir, run.history[-1])
    if log_metrics is not None:
        log_metrics(metrics, step)
    if config.log_samples_every and (step % config.log_samples_every == 0 or step == 1):
        path = write_samples(run.run_dir, step, rollouts.trajectories, adv.returns.tolist(), config.num_samples_logged)
        if log_artifact is not None:
            log_artifact(path)
    logger.info(
        "%s step %d/%d answer recall %.3f f1 %.3f retrieval recall %.3f (%.1fs)", config.method, step,
        config.total_steps, metrics["answer/recall"], metrics["answer/f1"], metrics["retrieval/recall"],
        metrics["perf/step_seconds"],
    )


def _validate(run: RunState, samples: Sequence[Mapping[str, Any]], search: Any, prompt_template: str,
              settings: ValidationSettings) -> dict[str, float]:
    """Validation of the current policy with the run's turn limits, decoded as ``settings`` says (greedy
    in batches, or sampled trajectories; timed as ``perf/validation_seconds``)."""
    config, started = run.config, time.perf_counter()
    metrics = validate_policy(run.model, run.tokenizer, samples, search, config.rollout, prompt_template,
                              max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                              bf16=run.bf16, validation=settings, temperature=config.temperature,
                              engine=config.engine)
    return {**metrics, "perf/validation_seconds": time.perf_counter() - started}


def record_validation(run: RunState, metrics: dict[str, float], log_metrics: MetricsLogger | None) -> None:
    """Step 0: the starting policy's validation scores, a history row of their own (verl logs it so too)."""
    run.history.append({"step": 0, **metrics})
    append_history(run.run_dir, run.history[-1])
    if log_metrics is not None:
        log_metrics(metrics, 0)
    logger.info("%s step 0 (before training): %s", run.config.method,
                ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("val/")))


def checkpoint(run: RunState, step: int, out_of_time: bool) -> None:
    """Every ``checkpoint_every`` steps, at the last step and when the time budget ran out."""
    config = run.config
    if (config.checkpoint_every and step % config.checkpoint_every == 0) or step == config.total_steps or out_of_time:
        save_checkpoint(run.run_dir, step, run.model, run.tokenizer, run.optimizer, run.scheduler,
                        extra={"method": config.method, "fingerprint": run.fingerprint, "settings": run.settings},
                        keep=config.keep_checkpoints)


def finish_run(run: RunState, step: int, out_of_time: bool) -> TrainResult:
    """Save the final model when the run is complete (all steps, or the time budget)."""
    final_dir = run.run_dir / "final"
    if out_of_time:
        logger.info("%s: time budget of %.0f s reached after step %d", run.config.method, run.config.max_seconds, step)
    if step >= run.config.total_steps or out_of_time:
        run.model.save_pretrained(final_dir)
        run.tokenizer.save_pretrained(final_dir)
    return TrainResult(final_dir, step, run.history, run.resumed_from)
