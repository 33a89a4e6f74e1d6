"""Mechanism metrics: do a group's trajectories differ, and do two methods' updates differ?

SPADER's peer advantage and exploration reward (arXiv 2606.00593, §3) only act where a group's
``G`` trajectories search differently: with identical trajectories the exploration reward is a
constant per group and cancels in the group normalisation, and the method's advantages equal
GRPO's up to scale. These functions measure exactly that, per training step, for any method:

* :func:`group_diversity` — per group of trajectories answering the same question: distinct query
  sequences, distinct retrieved documents, gold entities found by the group (union) against the
  mean trajectory, and the first turn at which the group's trajectories part;
* :func:`advantage_agreement` — Pearson correlation and relative L2 distance between a method's
  token advantages and the GRPO advantages of the same batch (computed beside it).

Both trainers log them under the names documented in ``docs/metrics.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from .methods import RewardInputs, get_method, method_advantages, method_rewards
from .rewards import SpaderRewardConfig
from .steps import StepLayout

__all__ = ["COMPARISON_METHOD", "advantage_agreement", "comparison_advantages", "group_diversity", "normalise_query"]

COMPARISON_METHOD = "grpo"
"""The method every run's advantages are compared with, on the run's own batch (``adv/*_vs_grpo``)."""

TurnAction = tuple[str, tuple[str, ...]]
"""One turn's action: its kind (``search``/``answer``/...) and its normalised queries or answers."""


def normalise_query(text: str) -> str:
    """Case- and whitespace-insensitive form of a query (``"Mel  Brooks"`` == ``"mel brooks"``)."""
    return " ".join(text.lower().split())


def _first_divergence(actions: Sequence[Sequence[TurnAction]]) -> int | None:
    """First turn (1-based) at which the group's action sequences differ; ``None`` if identical."""
    longest = max((len(a) for a in actions), default=0)
    for turn in range(longest):
        at_turn = {a[turn] if turn < len(a) else None for a in actions}
        if len(at_turn) > 1:
            return turn + 1
    return None


def group_diversity(
    index: Sequence[object] | np.ndarray,
    actions: Sequence[Sequence[TurnAction]],
    documents: Sequence[Sequence[str]],
    found: torch.Tensor,
    num_gt: torch.Tensor,
) -> dict[str, float]:
    """How differently each group's trajectories searched, averaged over the batch's groups.

    Args:
        index: ``[B]`` group label of each trajectory (one group per question).
        actions: per trajectory, its turns as :data:`TurnAction` (queries normalised by the caller
            with :func:`normalise_query`); the tuple of search turns is the trajectory's query sequence.
        documents: per trajectory, the identities of every document it retrieved.
        found: bool ``[B, S, E]`` gold entity ``e`` in the documents retrieved at step ``s``.
        num_gt: long ``[B]`` distinct gold entities of the trajectory's question.

    Returns:
        ``group/distinct_query_seqs`` — mean number of distinct query sequences per group;
        ``group/diverse_frac`` — share of groups with ≥ 2 distinct query sequences;
        ``group/distinct_docs`` — mean number of distinct documents a group retrieved;
        ``group/entity_recall_union`` — mean over groups of (gold entities found by any member) / |GT|;
        ``group/entity_recall_mean`` — mean over groups of the members' mean entity recall;
        ``group/first_divergence_turn`` — mean over diverging groups of the first turn whose actions
        differ (NaN when no group diverges); ``group/identical_frac`` — share of groups whose
        trajectories took identical actions throughout.
    """
    labels = np.asarray([str(i) for i in index])
    size = len(labels)
    if not (len(actions) == len(documents) == found.shape[0] == num_gt.shape[0] == size):
        raise ValueError(
            f"group_diversity: lengths differ (index {size}, actions {len(actions)}, documents {len(documents)}, "
            f"found {found.shape[0]}, num_gt {num_gt.shape[0]})"
        )
    if size == 0:
        return {}
    _, group_of = np.unique(labels, return_inverse=True)
    groups = group_of.max() + 1
    per_trajectory = found.bool().any(dim=1)  # [B, E]: found at any step
    gt = num_gt.clamp(min=1).float()
    trajectory_recall = per_trajectory.sum(dim=1).float() / gt

    group_ids = torch.as_tensor(group_of)
    union = torch.zeros((groups, per_trajectory.shape[1]), dtype=torch.long).index_add_(0, group_ids, per_trajectory.long()) > 0
    group_gt = torch.zeros(groups).scatter_reduce_(0, group_ids, gt, reduce="amax", include_self=False)
    members = torch.bincount(group_ids, minlength=groups).float()
    recall_union = union.sum(dim=1).float() / group_gt.clamp(min=1)
    recall_mean = torch.zeros(groups).index_add_(0, group_ids, trajectory_recall) / members

    distinct_seqs, distinct_docs, divergence = [], [], []
    for g in range(groups):
        rows = np.flatnonzero(group_of == g)
        group_actions = [tuple(actions[r]) for r in rows]
        distinct_seqs.append(len({tuple(a for a in acts if a[0] == "search") for acts in group_actions}))
        distinct_docs.append(len({d for r in rows for d in documents[r]}))
        divergence.append(_first_divergence(group_actions))
    diverging = [t for t in divergence if t is not None]
    return {
        "group/distinct_query_seqs": float(np.mean(distinct_seqs)),
        "group/diverse_frac": float(np.mean([n >= 2 for n in distinct_seqs])),
        "group/distinct_docs": float(np.mean(distinct_docs)),
        "group/entity_recall_union": float(recall_union.mean()),
        "group/entity_recall_mean": float(recall_mean.mean()),
        "group/first_divergence_turn": float(np.mean(diverging)) if diverging else math.nan,
        "group/identical_frac": float(np.mean([t is None for t in divergence])),
    }


def advantage_agreement(
    advantages: torch.Tensor, reference: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Agreement of a method's token advantages with a reference estimator's (GRPO's) on one batch.

    Args:
        advantages: float ``[B, T]`` the method's advantages.
        reference: float ``[B, T]`` GRPO's advantages of the same batch and rewards' outcome.
        response_mask: ``[B, T]`` 1 on model tokens (the only tokens compared).

    Returns:
        ``adv/corr_vs_grpo`` — Pearson correlation over model tokens (NaN when either side is
        constant, e.g. every group's outcome ties); ``adv/rel_l2_vs_grpo`` — ``‖A − A_grpo‖ / ‖A_grpo‖``
        over model tokens (NaN when the GRPO advantages are all 0). Identical advantages give 1 and 0.
        ``adv/grpo_zero_frac`` and ``adv/zero_frac`` — the share of model tokens to which GRPO, and
        the method, give advantage 0 (no gradient): defined where the two above are not, e.g. when
        every group's outcome ties, GRPO's is 1 while a method with a per-trajectory exploration
        reward can still be far from 1.
    """
    if advantages.shape != reference.shape or advantages.shape != response_mask.shape:
        raise ValueError(f"advantage_agreement: shapes differ {tuple(advantages.shape)}, "
                         f"{tuple(reference.shape)}, {tuple(response_mask.shape)}")
    keep = response_mask != 0
    a = advantages[keep].double()
    b = reference[keep].double()
    if a.numel() == 0:
        return {"adv/corr_vs_grpo": math.nan, "adv/rel_l2_vs_grpo": math.nan, "adv/zero_frac": math.nan,
                "adv/grpo_zero_frac": math.nan}
    a_c, b_c = a - a.mean(), b - b.mean()
    denominator = float(a_c.norm() * b_c.norm())
    corr = float((a_c * b_c).sum()) / denominator if denominator > 1e-12 else math.nan
    ref_norm = float(b.norm())
    rel = float((a - b).norm()) / ref_norm if ref_norm > 1e-12 else math.nan
    return {"adv/corr_vs_grpo": corr, "adv/rel_l2_vs_grpo": rel, "adv/zero_frac": float((a == 0).double().mean()),
            "adv/grpo_zero_frac": float((b == 0).double().mean())}


def comparison_advantages(
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray,
    inputs: RewardInputs,
    *,
    global_step: int,
    reward: SpaderRewardConfig,
    layout: StepLayout | None = None,
) -> torch.Tensor:
    """GRPO's token advantages ``[B, T]`` of a batch any method sampled: GRPO's outcome layout and
    estimator with its default options, the run's final-answer settings (``reward``) and GRPO's own
    tool cost. Both trainers compute it beside the method's advantages for :func:`advantage_agreement`."""
    method = get_method(COMPARISON_METHOD)
    options = method.options()
    reward = dataclasses.replace(reward, tool_round_cost=method.tool_round_cost)
    rewards = method_rewards(method.name, response_mask, index, inputs, global_step=global_step, reward=reward,
                             options=options, layout=layout)
    advantages, _ = method_advantages(method.name, rewards.token_rewards, response_mask, index, options, layout)
    return advantages
