"""The policy update of one native RL step: clipped PPO loss + KL to the reference, one AdamW step.

The loss functions are verl's own (``verl.trainer.ppo.core_algos``: ``compute_policy_loss_vanilla``
aggregated by ``agg_loss``, ``kl_penalty``), configured through verl's ``ActorConfig``, so the
native trainer optimises exactly what verl's actor does (docs/training.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from spader_pipeline.modeling.batching import token_budget_runs
from spader_pipeline.modeling.boundary import top_block_states
from spader_pipeline.modeling.shared_prefix import decoder_states, use_shared_prefix
from spader_pipeline.modeling.warm_start import autocast
from spader_pipeline.native.batch import Advantages, RolloutBatch
from spader_pipeline.native.config import NativeTrainerConfig

logger = logging.getLogger(__name__)


def response_logprobs(
    model, batch: RolloutBatch, rows: slice | torch.Tensor, *, temperature: float, bf16: bool | str, with_entropy: bool,
    use_boundary: bool = True, shared_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[b, R]`` of the sampled response tokens (0 off model tokens), optionally entropy.

    The decoder runs on the micro-batch's sequences (trimmed to their longest; with ``shared_prefix``
    the leading tokens all rows share, the prompt template's instruction, encoded once); the output layer runs only at
    positions that predict a model token (``response_mask == 1``). With ``batch.boundary`` (and
    ``use_boundary``: ``model``'s frozen blocks are the ones that computed it) only the blocks from
    ``batch.boundary_block`` up run, from the rollout's states (:func:`top_block_states`).
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
        if use_boundary and batch.boundary is not None:
            boundary = batch.boundary[rows, :width].to(device)
            hidden = top_block_states(model, boundary, input_ids, attention, first_block=batch.boundary_block,
                                      shared_prefix=shared_prefix)
        else:
            hidden = decoder_states(model, input_ids, attention, shared_prefix=shared_prefix)
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


def mini_batches(batch: RolloutBatch, count: int) -> list[torch.Tensor]:
    """Row indices of ``count`` mini-batches of whole groups (``batch.uids``), the groups in the
    order they first appear, dealt out in equal runs (``count`` divides the number of groups)."""
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(batch.uids.tolist()):
        groups.setdefault(uid, []).append(row)
    members = list(groups.values())
    if len(members) % count:
        raise ValueError(f"{len(members)} groups cannot be split into {count} equal mini-batches")
    per = len(members) // count
    return [torch.tensor([row for group in members[i * per : (i + 1) * per] for row in group]) for i in range(count)]


def length_sorted_micro_batches(batch: RolloutBatch, size: int, max_tokens: int | None = None,
                                rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Row indices of the micro-batches: rows (all, or ``rows``) sorted by length, at most ``size`` per
    micro-batch and, with ``max_tokens``, at most ``max_tokens`` padded tokens (rows × the longest row;
    a row longer than that is a micro-batch alone).

    Each micro-batch is trimmed to its longest sequence, so sorting keeps padding (wasted decoder
    work) small, and the token budget keeps long rows in small passes, where attention's
    quadratic cost and the padding to the longest row would otherwise dominate. The loss is a
    token-weighted sum over the whole batch, so the grouping of rows does not change the gradient.
    """
    rows = torch.arange(batch.attention_mask.shape[0]) if rows is None else rows
    lengths = batch.attention_mask[rows].sum(dim=1)
    by_length = torch.argsort(lengths, stable=True)
    order = rows[by_length]
    return [order[run.start : run.stop] for run in token_budget_runs(lengths[by_length].tolist(), max_tokens, size)]


def actor_config(config: NativeTrainerConfig) -> Any:
    """verl's ``ActorConfig`` for the loss functions (clip ratios, aggregation, KL settings)."""
    from verl.workers.config.actor import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=config.prompts_per_step // config.ppo_mini_batches,
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


@dataclass
class UpdateStats:
    """Loss terms summed over epochs (each epoch's terms are token-weighted means over the whole
    batch; divide by epochs for the logged means), the gradient norm (the mean over the step's
    optimiser steps, before clipping), the number of optimiser steps, and whether the passes encoded
    the rows' common prefix once (``config.shared_prefix`` on the model's device)."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("policy", "kl", "entropy", "clipfrac", "clipfrac_lower", "approx_kl"), 0.0))
    grad_norm: float = 0.0
    optimizer_steps: int = 0
    shared_prefix: bool = False


def update_policy(
    model, reference, optimizer, trainable, batch: RolloutBatch, adv: Advantages, config: NativeTrainerConfig,
    actor_cfg: Any, *, bf16: bool | str, step: int, reference_shares_boundary: bool = False,
) -> UpdateStats:
    """``config.ppo_epochs`` passes over the batch, each in ``config.ppo_mini_batches`` mini-batches of
    whole groups; per mini-batch the clipped PPO loss (token-mean over the mini-batch) plus
    ``kl_coef`` × KL to ``reference``, then one clipped optimiser step (verl's actor update with
    ``ppo_mini_batch_size = prompts_per_step / ppo_mini_batches``).

    The old (behaviour) log-probs are the rollout policy's: with one mini-batch, the first epoch's
    own, taken before its optimiser step; with several, a no-grad pass over the batch first (the
    parameters move after the first mini-batch). With ``batch.boundary`` every pass of the policy
    starts from the rollout's boundary states; the reference's too when ``reference_shares_boundary``
    (its frozen blocks equal the policy's, :func:`spader_pipeline.modeling.boundary.shares_frozen_blocks`).
    Every pass encodes the rows' common prefix once or not as ``config.shared_prefix`` says for the
    model's device (:func:`~spader_pipeline.modeling.shared_prefix.use_shared_prefix`).
    """
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    device = next(model.parameters()).device
    shared = use_shared_prefix(config.shared_prefix, device)
    policy_loss_fn = get_policy_loss_fn("vanilla")
    total_tokens = float(batch.response_mask.sum().clamp(min=1))
    parts = (mini_batches(batch, config.ppo_mini_batches) if config.ppo_mini_batches > 1
             else [torch.arange(len(batch.uids))])
    micro = [length_sorted_micro_batches(batch, config.micro_batch_size, config.micro_batch_max_tokens, rows)
             for rows in parts]
    old_logp = None
    if config.ppo_mini_batches > 1:  # the behaviour policy, before any optimiser step of this batch
        old_logp = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=device)
        with torch.no_grad():
            for rows in (r for runs in micro for r in runs):
                logp, _ = response_logprobs(model, batch, rows, temperature=config.temperature, bf16=bf16,
                                            with_entropy=False, shared_prefix=shared)
                old_logp[rows] = logp
    elif config.ppo_epochs > 1:  # kept from the first epoch's own pass (the parameters have not moved yet)
        old_logp = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=device)
    stats = UpdateStats(shared_prefix=shared)
    norms = []
    for epoch in range(config.ppo_epochs):
        for part, runs in zip(parts, micro, strict=True):
            part_tokens = float(batch.response_mask[part].sum().clamp(min=1))
            actor_cfg.global_batch_info.update(dp_size=1, batch_num_tokens=part_tokens, global_batch_size=len(part))
            share = part_tokens / total_tokens
            optimizer.zero_grad(set_to_none=True)
            for rows in runs:
                mask = batch.response_mask[rows].to(device)
                if mask.sum() == 0:
                    continue
                logp, entropy = response_logprobs(model, batch, rows, temperature=config.temperature,
                                                  bf16=bf16, with_entropy=True, shared_prefix=shared)
                if config.ppo_mini_batches == 1 and epoch == 0:
                    old = logp.detach()
                    if old_logp is not None:
                        old_logp[rows] = old
                else:
                    old = old_logp[rows]
                pg_loss, pg_metrics = policy_loss_fn(
                    old_log_prob=old, log_prob=logp, advantages=adv.advantages[rows].to(device), response_mask=mask,
                    loss_agg_mode=config.loss_agg_mode, config=actor_cfg,
                )
                loss = pg_loss + _kl_loss(reference, logp, batch, rows, mask, config, actor_cfg, bf16, stats,
                                          use_boundary=reference_shares_boundary, share=share, shared_prefix=shared)
                loss.backward()
                _accumulate(stats, pg_loss, pg_metrics, entropy, mask, weight=float(mask.sum()) / total_tokens,
                            share=share)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm))
            norms.append(grad_norm)
            if math.isfinite(grad_norm):
                optimizer.step()
                stats.optimizer_steps += 1
            else:
                logger.warning("step %d: non-finite gradient norm, update skipped", step)
    stats.grad_norm = sum(norms) / len(norms)
    return stats


def _kl_loss(reference, logp, batch, rows, mask, config, actor_cfg, bf16, stats: UpdateStats, *,
             use_boundary: bool, share: float = 1.0, shared_prefix: bool = True) -> torch.Tensor | float:
    """``kl_coef`` × KL(policy ‖ reference) of the micro-batch (0 without a reference model);
    ``share``: the mini-batch's part of the batch's tokens (the logged sum is over the batch)."""
    if reference is None:
        return 0.0
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

    with torch.no_grad():
        ref_logp, _ = response_logprobs(reference, batch, rows, temperature=config.temperature,
                                        bf16=bf16, with_entropy=False, use_boundary=use_boundary,
                                        shared_prefix=shared_prefix)
    kl = kl_penalty(logp, ref_logp, config.kl_type)
    kl_loss = agg_loss(kl, mask, config.loss_agg_mode, **actor_cfg.global_batch_info)
    stats.sums["kl"] += share * float(kl_loss.detach())
    return config.kl_coef * kl_loss


def _accumulate(stats: UpdateStats, pg_loss, pg_metrics, entropy, mask, *, weight: float, share: float = 1.0) -> None:
    sums = stats.sums
    sums["policy"] += share * float(pg_loss.detach())
    sums["entropy"] += weight * float((entropy * mask).sum() / mask.sum())
    sums["clipfrac"] += weight * pg_metrics["actor/pg_clipfrac"]
    sums["clipfrac_lower"] += weight * pg_metrics["actor/pg_clipfrac_lower"]
    sums["approx_kl"] += weight * pg_metrics["actor/ppo_kl"]
