"""Native single-process RL trainer (CPU or one GPU), top to bottom in the CleanRL manner.

One step::

    questions ──► n rollouts each (HF generator, real search) ──► rewards + advantages
      (algorithms core; GRPO via verl) ──► clipped PPO loss + low-variance KL (verl core_algos)
      ──► AdamW step ──► metrics, samples, checkpoint

``# ALGO LOGIC`` marks the algorithm, ``# PLUMBING`` the bookkeeping. The maths lives in
:mod:`spader_pipeline.algorithms` and ``verl.trainer.ppo.core_algos``; nothing is re-derived here.

Logged metrics (MLflow, ``step`` = global step, keys prefixed with the run's ``metric_prefix``;
definitions in docs/training.md):

- ``method_reward/mean``, ``method_reward/std`` — return (sum of token rewards) per trajectory;
  ``method_reward/final_mean`` — the final-answer term; ``method_reward/discovery_mean`` — novelty-weighted discovery
  reward (SPADER); ``method_reward/tool_cost_coef`` — ``c_eff`` at this step;
- ``answer/f1``, ``answer/recall``, ``answer/precision``, ``answer/format_ok`` — final answers;
- ``retrieval/entities_found``, ``retrieval/recall`` — gold entities surfaced in retrieved documents
  (count, fraction of gold); ``rollout/turns``, ``rollout/tool_calls``, ``rollout/response_tokens``,
  ``rollout/model_tokens``;
- ``adv/mean``, ``adv/std``, ``adv/abs_mean``, ``adv/zero_groups`` (fraction of groups without spread);
- ``loss/policy``, ``loss/kl``, ``loss/total``, ``policy/entropy``, ``policy/clipfrac``,
  ``policy/clipfrac_lower``, ``policy/approx_kl``, ``optim/grad_norm``, ``optim/lr``;
- ``perf/rollout_seconds``, ``perf/update_seconds``, ``perf/step_seconds``,
  ``perf/generate_tokens_per_second``, ``perf/train_tokens_per_second``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.rollout import SamplingParams, run_rollouts_sync
from spader_pipeline.modeling.base_model import load_model_and_tokenizer, train_top_layers
from spader_pipeline.modeling.device import resolve_device
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.modeling.shared_prefix import decoder_states
from spader_pipeline.modeling.warm_start import autocast
from spader_pipeline.native.batch import RolloutBatch, build_batch, compute_advantages
from spader_pipeline.native.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
    set_rng_state,
)
from spader_pipeline.native.config import NativeTrainerConfig

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


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC: log-probabilities of the response tokens under the policy
# ----------------------------------------------------------------------------------------------


def response_logprobs(
    model, batch: RolloutBatch, rows: slice | torch.Tensor, *, temperature: float, bf16: bool | str, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[b, R]`` of the sampled response tokens (0 off model tokens), optionally entropy.

    The decoder runs on the micro-batch's sequences (trimmed to their longest; the leading tokens
    all rows share, the prompt template's instruction, encoded once); the output layer runs only at
    positions that predict a model token (``response_mask == 1``).
    """
    mask = batch.response_mask[rows]
    device = next(model.parameters()).device
    lengths = batch.attention_mask[rows].sum(dim=1)
    width = int(lengths.max())
    input_ids = batch.input_ids[rows, :width].to(device)
    attention = batch.attention_mask[rows, :width].to(device)
    r_idx, c_idx = mask.nonzero(as_tuple=True)
    positions = batch.prompt_lengths[rows][r_idx] + c_idx - 1  # logits at p-1 predict token p
    targets = batch.response_ids[rows][r_idx, c_idx].to(device)
    with autocast(input_ids.device, bf16):
        hidden = decoder_states(model, input_ids, attention)  # the shared instruction encoded once
        logits = model.lm_head(hidden[r_idx.to(device), positions.to(device)])
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    token_logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    out[r_idx.to(device), c_idx.to(device)] = token_logp
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(dim=-1).detach()
        entropy = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        entropy[r_idx.to(device), c_idx.to(device)] = ent
    return out, entropy


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


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
) -> TrainResult:
    """Train the model at ``model_path`` with ``config.method``; write checkpoints and the final model.

    Args:
        samples: training questions, each ``{"id", "question", "ground_truth"}``.
        search: an async search backend (``RetrievalClient`` or ``retrieval.service.LocalSearch``).
        run_dir: output directory (checkpoints, ``final/``, ``metrics.jsonl``, ``samples/``).
        prompt_template: the prompt template text (``{question}`` placeholder).
        log_metrics / log_artifact: callbacks (e.g. MLflow); ``None`` = only local files.
        stop_after: end after this global step without finishing (tests of resume).
    """
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
    from verl.workers.config.actor import ActorConfig

    if not samples:
        raise ValueError("no training samples")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))

    # PLUMBING: seeding, device, model, reference model, optimizer, resume
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    fingerprint = _fingerprint(config, model_path)
    resume = latest_checkpoint(run_dir) if config.resume else None
    if resume and load_trainer_state(resume[1])["extra"].get("fingerprint") != fingerprint:
        logger.warning("checkpoints in %s belong to another configuration or start model; starting afresh", run_dir)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        resume = None
    start_path = resume[1] if resume else model_path
    model, tokenizer = load_model_and_tokenizer(start_path, device=device)
    trainable = train_top_layers(model, config.trainable_layers)
    bf16 = resolve_bf16(config.bf16, device, model)
    reference = None
    if config.kl_coef > 0:  # the reference is always the model the run started from
        reference = model if not resume else load_model_and_tokenizer(model_path, device=device)[0]
        reference = copy.deepcopy(reference).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay
    )
    warmup = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    history = _read_history(run_dir) if resume else []
    start_step = 0
    if resume:
        state = load_trainer_state(resume[1])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start_step = int(state["step"])
        history = [h for h in history if h["step"] <= start_step]
        logger.info("resuming %s from step %d (%s)", config.method, start_step, resume[1])
    _write_history(run_dir, history)

    actor_cfg = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=config.prompts_per_step,
        ppo_micro_batch_size_per_gpu=config.micro_batch_size,
        rollout_n=config.group_size,
        clip_ratio=config.clip_ratio_low,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=config.loss_agg_mode,
        use_kl_loss=config.kl_coef > 0,
        kl_loss_coef=config.kl_coef,
        kl_loss_type=config.kl_type,
    )
    policy_loss_fn = get_policy_loss_fn("vanilla")
    rollout_cfg = config.rollout
    pad_id = tokenizer.pad_token_id

    step = start_step
    run_started = time.perf_counter()
    out_of_time = False
    while step < config.total_steps and not out_of_time:
        step += 1
        t_step = time.perf_counter()

        # ALGO LOGIC: rollouts — prompts_per_step questions × group_size samples each
        questions = _questions_for_step(samples, step, config.prompts_per_step, config.seed)
        group = [
            {**q, "uid": f"{step}-{k}"} for k, q in enumerate(questions) for _ in range(config.group_size)
        ]
        sampling = SamplingParams(
            temperature=config.temperature, max_new_tokens=config.max_new_tokens, seed=config.seed * 100_003 + step
        )
        generator = HFGenerator(model, tokenizer, sampling, max_prompt_tokens=config.max_prompt_tokens,
                                micro_batch_size=config.batch_size, bf16=bf16)
        t0 = time.perf_counter()
        trajectories = run_rollouts_sync(group, generator, search, rollout_cfg, prompt_template)
        rollout_seconds = time.perf_counter() - t0
        batch = build_batch(trajectories, group, pad_id)

        # ALGO LOGIC: rewards and advantages (global step drives the tool-cost schedule)
        adv = compute_advantages(batch, config.method, global_step=step, reward=config.reward, options=config.options)

        # ALGO LOGIC: clipped PPO loss (token-mean over the whole batch) + KL to the reference
        t1 = time.perf_counter()
        model.train()
        total_tokens = float(batch.response_mask.sum().clamp(min=1))
        actor_cfg.global_batch_info.update(dp_size=1, batch_num_tokens=total_tokens, global_batch_size=len(group))
        old_logp = None
        if config.ppo_epochs > 1:
            with torch.no_grad():
                old_logp = _all_logprobs(model, batch, config, bf16)
        sums = {"policy": 0.0, "kl": 0.0, "entropy": 0.0, "clipfrac": 0.0, "clipfrac_lower": 0.0, "approx_kl": 0.0}
        grad_norm = 0.0
        for _epoch in range(config.ppo_epochs):
            optimizer.zero_grad(set_to_none=True)
            for rows in _length_sorted_micro_batches(batch, config.micro_batch_size):
                mask = batch.response_mask[rows].to(device)
                if mask.sum() == 0:
                    continue
                weight = float(mask.sum()) / total_tokens
                logp, entropy = response_logprobs(model, batch, rows, temperature=config.temperature,
                                                  bf16=bf16, with_entropy=True)
                old = logp.detach() if old_logp is None else old_logp[rows].to(device)
                advantages = adv.advantages[rows].to(device)
                pg_loss, pg_metrics = policy_loss_fn(
                    old_log_prob=old, log_prob=logp, advantages=advantages, response_mask=mask,
                    loss_agg_mode=config.loss_agg_mode, config=actor_cfg,
                )
                loss = pg_loss
                if reference is not None:
                    with torch.no_grad():
                        ref_logp, _ = response_logprobs(reference, batch, rows, temperature=config.temperature,
                                                        bf16=bf16, with_entropy=False)
                    kl = kl_penalty(logp, ref_logp, config.kl_type)
                    kl_loss = agg_loss(kl, mask, config.loss_agg_mode, **actor_cfg.global_batch_info)
                    loss = loss + config.kl_coef * kl_loss
                    sums["kl"] += float(kl_loss.detach())
                loss.backward()
                sums["policy"] += float(pg_loss.detach())
                sums["entropy"] += weight * float((entropy * mask).sum() / mask.sum())
                sums["clipfrac"] += weight * pg_metrics["actor/pg_clipfrac"]
                sums["clipfrac_lower"] += weight * pg_metrics["actor/pg_clipfrac_lower"]
                sums["approx_kl"] += weight * pg_metrics["actor/ppo_kl"]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm))
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                logger.warning("step %d: non-finite gradient norm, update skipped", step)
        scheduler.step()
        model.eval()
        update_seconds = time.perf_counter() - t1

        # PLUMBING: metrics, samples, checkpoint
        metrics = _step_metrics(batch, adv, sums, config.ppo_epochs)
        metrics.update({
            "optim/grad_norm": grad_norm,
            "optim/lr": scheduler.get_last_lr()[0],
            "loss/total": (sums["policy"] + config.kl_coef * sums["kl"]) / config.ppo_epochs,
            "perf/rollout_seconds": rollout_seconds,
            "perf/update_seconds": update_seconds,
            "perf/step_seconds": time.perf_counter() - t_step,
            "perf/generate_tokens_per_second": generator.generated_tokens / max(rollout_seconds, 1e-9),
            "perf/train_tokens_per_second": float(batch.attention_mask.sum()) * config.ppo_epochs / max(update_seconds, 1e-9),
        })
        history.append({"step": step, **metrics})
        _append_history(run_dir, history[-1])
        if log_metrics is not None:
            log_metrics(metrics, step)
        if config.log_samples_every and (step % config.log_samples_every == 0 or step == 1):
            path = _write_samples(run_dir, step, trajectories, adv, config.num_samples_logged)
            if log_artifact is not None:
                log_artifact(path)
        logger.info(
            "%s step %d/%d reward %.3f f1 %.3f retrieval recall %.3f (%.1fs)", config.method, step,
            config.total_steps, metrics["method_reward/mean"], metrics["answer/f1"], metrics["retrieval/recall"],
            metrics["perf/step_seconds"],
        )
        out_of_time = config.max_seconds is not None and time.perf_counter() - run_started > config.max_seconds
        if (config.checkpoint_every and step % config.checkpoint_every == 0) or step == config.total_steps or out_of_time:
            save_checkpoint(run_dir, step, model, tokenizer, optimizer, scheduler,
                            extra={"method": config.method, "fingerprint": fingerprint}, keep=config.keep_checkpoints)
        if stop_after is not None and step >= stop_after:
            break

    final_dir = run_dir / "final"
    if out_of_time:
        logger.info("%s: time budget of %.0f s reached after step %d", config.method, config.max_seconds, step)
    if step >= config.total_steps or out_of_time:
        model.save_pretrained(final_dir)
        tokenizer.save_pretrained(final_dir)
    return TrainResult(final_dir, step, history, resume[0] if resume else None)


# ----------------------------------------------------------------------------------------------
# PLUMBING helpers
# ----------------------------------------------------------------------------------------------


def _fingerprint(config: NativeTrainerConfig, model_path: str | Path) -> str:
    """Identity of a run for resume: the settings that shape its trajectory and the start weights."""
    settings = {k: v for k, v in config.to_dict().items()
                if k not in ("total_steps", "max_seconds", "resume", "checkpoint_every", "keep_checkpoints",
                             "log_samples_every", "num_samples_logged", "device")}
    weights = sorted(Path(model_path).glob("*.safetensors")) or sorted(Path(model_path).glob("*.bin"))
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
    blob = json.dumps([settings, str(Path(model_path).resolve()), stamp], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _questions_for_step(samples: Sequence[Mapping[str, Any]], step: int, k: int, seed: int) -> list[Mapping[str, Any]]:
    """The ``k`` questions of global step ``step`` (1-based): a seeded permutation per epoch.

    A pure function of the step, so a resumed run sees exactly the questions it would have seen.
    """
    n = len(samples)
    out = []
    for j in range((step - 1) * k, step * k):
        epoch, pos = divmod(j, n)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(samples[int(order[pos])])
    return out


def _length_sorted_micro_batches(batch: RolloutBatch, size: int) -> list[torch.Tensor]:
    """Row indices of the micro-batches: rows sorted by length, ``size`` per micro-batch.

    Each micro-batch is trimmed to its longest sequence, so sorting keeps padding (wasted decoder
    work) small. The loss is a token-weighted sum over the whole batch, so the grouping of rows
    does not change the gradient.
    """
    order = torch.argsort(batch.attention_mask.sum(dim=1), stable=True)
    return list(order.split(size))


def _all_logprobs(model, batch: RolloutBatch, config: NativeTrainerConfig, bf16: bool) -> torch.Tensor:
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    for rows in _length_sorted_micro_batches(batch, config.micro_batch_size):
        logp, _ = response_logprobs(model, batch, rows, temperature=config.temperature, bf16=bf16,
                                    with_entropy=False)
        out[rows] = logp.cpu()
    return out


def _step_metrics(batch: RolloutBatch, adv, sums: dict[str, float], epochs: int) -> dict[str, float]:
    mask = batch.response_mask
    returns = adv.returns
    traj_found = batch.found.any(dim=1).sum(dim=-1).float() if batch.found.numel() else torch.zeros(len(mask))
    gt = batch.num_gt.float().clamp(min=1)
    tok_adv = adv.advantages[mask.bool()]
    groups: dict[str, list[float]] = {}
    for uid, r in zip(batch.uids.tolist(), returns.tolist(), strict=True):
        groups.setdefault(uid, []).append(r)
    zero_groups = sum(1 for v in groups.values() if max(v) - min(v) < 1e-8) / max(len(groups), 1)
    return {
        "method_reward/mean": float(returns.mean()),
        "method_reward/std": float(returns.std()) if len(returns) > 1 else 0.0,
        "method_reward/final_mean": float(torch.where(batch.format_ok, batch.f1, torch.zeros_like(batch.f1)).mean()),
        "method_reward/discovery_mean": float(adv.discovery.mean()),
        "method_reward/tool_cost_coef": float(adv.cost_coefficient),
        "answer/f1": float(batch.f1.mean()),
        "answer/recall": float(batch.recall.mean()),
        "answer/precision": float(batch.precision.mean()),
        "answer/format_ok": float(batch.format_ok.float().mean()),
        "retrieval/entities_found": float(traj_found.mean()),
        "retrieval/recall": float((traj_found / gt).mean()),
        "rollout/turns": float(batch.num_turns.mean()),
        "rollout/tool_calls": float(batch.num_searches.mean()),
        "rollout/response_tokens": float((batch.attention_mask.sum(dim=1) - batch.prompt_lengths).float().mean()),
        "rollout/model_tokens": float(mask.sum(dim=1).mean()),
        "adv/mean": float(tok_adv.mean()) if tok_adv.numel() else 0.0,
        "adv/std": float(tok_adv.std()) if tok_adv.numel() > 1 else 0.0,
        "adv/abs_mean": float(tok_adv.abs().mean()) if tok_adv.numel() else 0.0,
        "adv/zero_groups": zero_groups,
        "loss/policy": sums["policy"] / epochs,
        "loss/kl": sums["kl"] / epochs,
        "policy/entropy": sums["entropy"] / epochs,
        "policy/clipfrac": sums["clipfrac"] / epochs,
        "policy/clipfrac_lower": sums["clipfrac_lower"] / epochs,
        "policy/approx_kl": sums["approx_kl"] / epochs,
    }


def _history_path(run_dir: Path) -> Path:
    return run_dir / "metrics.jsonl"


def _read_history(run_dir: Path) -> list[dict[str, float]]:
    path = _history_path(run_dir)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return rows


def _write_history(run_dir: Path, history: list[dict[str, float]]) -> None:
    _history_path(run_dir).write_text("".join(json.dumps(h) + "\n" for h in history))


def _append_history(run_dir: Path, row: dict[str, float]) -> None:
    with _history_path(run_dir).open("a") as f:
        f.write(json.dumps(row) + "\n")


def _write_samples(run_dir: Path, step: int, trajectories, adv, k: int) -> Path:
    path = run_dir / "samples" / f"step_{step:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    returns = adv.returns.tolist()
    records = []
    for t, ret in list(zip(trajectories, returns, strict=True))[:k]:
        records.append({
            "id": t.id, "question": t.question, "return": ret, "finish_reason": t.finish_reason,
            "predicted": list(t.predicted) if t.predicted is not None else None, "messages": t.messages[1:],
        })
    path.write_text(json.dumps(records, indent=1, ensure_ascii=False))
    return path
