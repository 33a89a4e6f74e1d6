"""Per-step metrics of the native trainer (names and definitions: docs/metrics.md).

Comparable across methods: ``answer/*``, ``retrieval/*``, ``rollout/*``, ``group/*`` and
``adv/corr_vs_grpo``; the scale of ``method_reward/*`` and ``adv/mean|std|abs_mean`` depends on the
method's reward terms.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from spader_pipeline.algorithms.group_metrics import advantage_agreement, group_diversity, normalise_query
from spader_pipeline.algorithms.step_metrics import rollout_step_metrics
from spader_pipeline.host_memory import release_free_heap, rss_bytes
from spader_pipeline.native.batch import Advantages, RolloutBatch, Rollouts
from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.native.update import UpdateStats


def step_metrics(batch: RolloutBatch, adv: Advantages, update: UpdateStats, epochs: int) -> dict[str, float]:
    """Rewards, answers, retrieval, trajectory shape, advantages (:func:`rollout_step_metrics`, the same
    on the verl backend) and loss terms of one step."""
    sums = update.sums
    return {
        **rollout_step_metrics(
            returns=adv.returns, discovery=adv.discovery, cost_coefficient=adv.cost_coefficient,
            f1=batch.rewards.f1, recall=batch.recall, precision=batch.precision, format_ok=batch.rewards.format_ok,
            found=batch.rewards.found, num_gt=batch.rewards.num_gt, num_turns=batch.num_turns,
            num_searches=batch.num_searches, response_tokens=batch.attention_mask.sum(dim=1) - batch.prompt_lengths,
            response_mask=batch.response_mask, advantages=adv.advantages, uids=batch.uids.tolist(),
        ),
        "loss/policy": sums["policy"] / epochs,
        "loss/kl": sums["kl"] / epochs,
        "policy/entropy": sums["entropy"] / epochs,
        "policy/clipfrac": sums["clipfrac"] / epochs,
        "policy/clipfrac_lower": sums["clipfrac_lower"] / epochs,
        "policy/approx_kl": sums["approx_kl"] / epochs,
    }


def turn_actions(trajectory: Any) -> list[tuple[str, tuple[str, ...]]]:
    """A trajectory's turns as ``(kind, normalised queries or answers)`` (group_metrics.TurnAction)."""
    actions = []
    for step in trajectory.steps:
        items = step.queries if step.kind == "search" else step.answers
        actions.append((step.kind, tuple(normalise_query(str(x)) for x in items)))
    return actions


def retrieved_documents(trajectory: Any) -> list[str]:
    """Identities of every document the trajectory retrieved (all turns, all queries)."""
    return [doc for step in trajectory.steps for per_query in step.doc_ids for doc in per_query]


def search_failures(trajectories: Sequence[Any]) -> dict[str, float]:
    """``rollout/search_failed``: the share of the step's search turns whose search failed (the
    service or index raised; the model saw an error observation instead of passages). Anything above 0
    means the rewards were earned against a broken tool: the retrieval log says why."""
    searches = [s for t in trajectories for s in t.steps if s.kind == "search"]
    failed = sum(s.error_kind == "search_failed" for s in searches)
    return {"rollout/search_failed": failed / max(len(searches), 1)}


def mechanism_metrics(
    batch: RolloutBatch, trajectories: Sequence[Any], adv: Advantages, grpo: torch.Tensor
) -> dict[str, float]:
    """Whether groups explored differently (``group/*``) and whether the method's advantages differ
    from GRPO's on the same batch (``adv/corr_vs_grpo``, ``adv/rel_l2_vs_grpo``)."""
    diversity = group_diversity(
        batch.uids, [turn_actions(t) for t in trajectories], [retrieved_documents(t) for t in trajectories],
        batch.rewards.found, batch.rewards.num_gt,
    )
    return {**diversity, **advantage_agreement(adv.advantages, grpo, batch.response_mask)}


def step_report(config: NativeTrainerConfig, rollouts: Rollouts, adv: Advantages, grpo: torch.Tensor,
                update: UpdateStats, timing: Mapping[str, float], *, lr: float) -> dict[str, float]:
    """All metrics of the step (docs/metrics.md); ``timing``: the update's seconds and the step's
    start (``perf_counter``); ``lr``: the learning rate the step's update used."""
    batch = rollouts.batch
    metrics = step_metrics(batch, adv, update, config.ppo_epochs)
    metrics.update(mechanism_metrics(batch, rollouts.trajectories, adv, grpo))
    metrics.update(search_failures(rollouts.trajectories))
    metrics.update({
        "optim/grad_norm": update.grad_norm,
        "optim/steps": float(update.optimizer_steps),
        "optim/lr": lr,
        "loss/total": (update.sums["policy"] + config.kl_coef * update.sums["kl"]) / config.ppo_epochs,
        "perf/rollout_seconds": rollouts.seconds,
        "perf/capture_seconds": rollouts.capture_seconds,
        "perf/rollout_model_seconds": rollouts.model_seconds,
        "perf/rollout_decode_steps": float(rollouts.decode_steps),
        "perf/rollout_prefill_seconds": rollouts.prefill_seconds,
        "perf/rollout_decoding_seconds": rollouts.decoding_seconds,
        "perf/rollout_prefill_padding": 1.0 - rollouts.prefill_tokens / max(rollouts.prefill_positions, 1),
        "perf/reused_rollout_states": float(batch.boundary is not None),
        "perf/shared_prefix": float(update.shared_prefix),
        "perf/update_seconds": timing["update"],
        "perf/step_seconds": time.perf_counter() - timing["step_started"],
        "perf/generate_tokens_per_second": rollouts.generated_tokens / max(rollouts.seconds, 1e-9),
        "perf/train_tokens_per_second": float(batch.attention_mask.sum()) * config.ppo_epochs
        / max(timing["update"], 1e-9),
    })
    return metrics


def host_memory_report() -> dict[str, float]:
    """Hand the step's freed heap back to the operating system and report the resident size after
    it (``perf/rss_gb``; nothing where ``/proc`` is absent): a run whose ``perf/rss_gb`` still climbs
    keeps something (docs/reliability.md, memory)."""
    release_free_heap()
    rss = rss_bytes()
    return {} if rss is None else {"perf/rss_gb": rss / 2**30}
