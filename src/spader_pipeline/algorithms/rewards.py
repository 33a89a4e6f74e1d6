"""Rewards for multi-answer search agents: final-answer F1 and SPADER's diversity-aware exploration reward.

SPADER (arXiv 2606.00593; docs/algorithms.md). For trajectory ``i`` of a prompt group, decision step ``t``
(the ``t``-th run of model tokens) and the documents retrieved by that step's tool call:

* ``found_{i,t}`` — ground-truth entities with an alias in those **retrieved documents** (whole words,
  normalised; never the model's own query text, which would credit naming an entity as finding it);
* ``new_{i,t} = found_{i,t} \\ ∪_{k<t} found_{i,k}`` — first discovery within the trajectory;
* ``N(e)`` — number of trajectories of the group that found ``e`` at any step;
* ``r_{i,t} = (1/|GT|)·[Σ_{e∈new_{i,t}} (α + β·exp(−λ·(N(e)−1))) − c_eff·Count_{i,t}]`` where
  ``Count_{i,t}`` is the number of queries the step executed and ``c_eff`` follows the warm-up schedule of
  :func:`tool_cost_coefficient`, driven by the trainer's real global step (without it the schedule
  stays at step 0 and the cost is never applied).
* the final step additionally receives the outcome ``w_F·F1`` (or ``−format_penalty`` on a format
  error), :func:`outcome_reward`, the term every method shares.

``|GT|`` is the number of distinct normalised entities (the SPADER release code used the raw list length).
Everything is batch-vectorised: discovery is one Aho-Corasick pass per prompt group
(:mod:`.matching`), the rest is tensor algebra over ``found`` of shape ``[B, S, E]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .advantages._groups import group_index
from .entity_search import find_entities_in_steps
from .matching import GroundTruth, normalize_ground_truths
from .steps import StepLayout, gather_steps, place_on_anchors, segment_steps

__all__ = [
    "ExplorationRewards",
    "SpaderRewardConfig",
    "SpaderRewards",
    "discover_entities",
    "exploration_step_rewards",
    "final_answer_reward",
    "first_discoveries",
    "first_occurrence_steps",
    "novelty_weight",
    "outcome_reward",
    "spader_rewards",
    "tool_cost_coefficient",
]


@dataclass(frozen=True)
class SpaderRewardConfig:
    """Hyper-parameters of the SPADER reward (defaults = the paper's Qwen3 configs).

    Attributes:
        alpha, beta, lam: novelty weight ``α + β·exp(−λ·(N(e)−1))``.
        tool_round_cost: ``c``, cost per executed query, divided by ``|GT|``.
        cost_free_steps: global steps before the cost starts (the Llama-3.1 scripts use 200).
        cost_rampup_steps: steps over which the cost ramps linearly from 0 to ``c``.
        final_answer_weight: ``w_F`` on the final-answer F1.
        format_penalty: reward ``−format_penalty`` replaces ``w_F·F1`` on a format error (the SPADER
            reference code used 0, its GRPO baseline and the paper's figure −1).
        enable_exploration: ``False`` reduces the reward to the final-answer term (the GRPO reward).
    """

    alpha: float = 1.0
    beta: float = 4.0
    lam: float = 1.0
    tool_round_cost: float = 0.01
    cost_free_steps: int = 100
    cost_rampup_steps: int = 100
    final_answer_weight: float = 1.0
    format_penalty: float = 0.0
    enable_exploration: bool = True

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "lam", "tool_round_cost", "final_answer_weight", "format_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.cost_free_steps < 0 or self.cost_rampup_steps < 0:
            raise ValueError("cost_free_steps and cost_rampup_steps must be >= 0")


def tool_cost_coefficient(global_step: int, *, cost: float, free_steps: int, rampup_steps: int) -> float:
    """Warm-up schedule of the tool cost ``c_eff(s)`` (SPADER, arXiv 2606.00593).

    ``0`` while ``s < free_steps``; ``c·(s − free_steps)/rampup_steps`` during the ramp; ``c`` afterwards.
    """
    if cost == 0 or global_step < free_steps:
        return 0.0
    if rampup_steps > 0 and global_step - free_steps < rampup_steps:
        return cost * (global_step - free_steps) / rampup_steps
    return float(cost)


def novelty_weight(counts: torch.Tensor, *, alpha: float, beta: float, lam: float) -> torch.Tensor:
    """``α + β·exp(−λ·(N − 1))`` elementwise (N = 1 → α+β; large N → α)."""
    return alpha + beta * torch.exp(-lam * (counts.float() - 1.0))


def first_discoveries(found: torch.Tensor) -> torch.Tensor:
    """bool ``[B, S, E]``: entity found at step ``t`` and at no earlier step of the same trajectory."""
    seen_before = torch.nn.functional.pad(found.long().cumsum(dim=1)[:, :-1], (0, 0, 1, 0)) > 0
    return found & ~seen_before


def first_occurrence_steps(found: torch.Tensor) -> torch.Tensor:
    """long ``[B]``: first step whose documents contain any gold entity, ``-1`` if none (TSPO's ``k*``)."""
    any_step = found.any(dim=2)
    first = any_step.long().argmax(dim=1)
    return torch.where(any_step.any(dim=1), first, torch.full_like(first, -1))


def discover_entities(
    ground_truths: Sequence[Sequence[Sequence[str]] | GroundTruth],
    step_documents: Sequence[Sequence[str]],
    *,
    num_steps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which gold entities each step's retrieved documents contain.

    Args:
        ground_truths: per trajectory, ``[[alias, ...], ...]`` (rollouts of one prompt share it).
        step_documents: per trajectory, per step, the documents that step retrieved: a list of
            document texts (``[]`` for steps without a tool call), or one string. Pass document text
            only — never the query. Each distinct document is normalised once per batch, so passing
            documents separately (rather than one joined string per step) lets repeats be shared.
        num_steps: width ``S`` (default: longest list).
    Returns:
        ``found`` bool ``[B, S, E]`` (``E`` = most entities of any trajectory; padded entities are False)
        and ``num_gt`` long ``[B]`` (distinct normalised entities).
    """
    gts = normalize_ground_truths(ground_truths)
    width = num_steps if num_steps is not None else max((len(s) for s in step_documents), default=0)
    num_gt = torch.tensor([len(g) for g in gts], dtype=torch.long)
    found = find_entities_in_steps(gts, step_documents, width)
    return torch.from_numpy(found), num_gt


@dataclass(frozen=True)
class ExplorationRewards:
    """Result of :func:`exploration_step_rewards` (all on the step axis).

    Attributes:
        step_rewards: float ``[B, S]``, discovery reward minus tool cost.
        discovery: float ``[B, S]``, the discovery part alone.
        new: bool ``[B, S, E]``, first discoveries.
        group_counts: long ``[B, E]``, ``N(e)`` as seen from each trajectory's group.
        cost_coefficient: the ``c_eff`` applied.
    """

    step_rewards: torch.Tensor
    discovery: torch.Tensor
    new: torch.Tensor
    group_counts: torch.Tensor
    cost_coefficient: float


def exploration_step_rewards(
    found: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    num_gt: torch.Tensor,
    query_counts: torch.Tensor,
    *,
    global_step: int,
    config: SpaderRewardConfig = SpaderRewardConfig(),
) -> ExplorationRewards:
    """SPADER's per-step exploration reward, vectorised over the batch.

    Args:
        found: bool ``[B, S, E]`` from :func:`discover_entities`.
        index: ``[B]`` prompt-group labels (``uid``).
        num_gt: ``[B]`` distinct gold entities; rows with 0 get reward 0 and no cost.
        query_counts: ``[B, S]`` queries executed by each step's tool call (0 if none).
        global_step: the trainer's current step (drives the tool-cost warm-up).
    """
    groups = group_index(index, device=found.device)
    traj_found = found.any(dim=1).long()  # [B, E]
    counts = groups.sum(traj_found)[groups.ids]  # N(e) seen from each member, [B, E]
    weights = novelty_weight(counts, alpha=config.alpha, beta=config.beta, lam=config.lam)
    new = first_discoveries(found)
    gt = num_gt.to(found.device).float()
    has_gt = gt > 0
    denom = torch.where(has_gt, gt, torch.ones_like(gt)).unsqueeze(1)
    discovery = (new.float() * weights.unsqueeze(1)).sum(dim=2) / denom
    c_eff = tool_cost_coefficient(
        global_step,
        cost=config.tool_round_cost,
        free_steps=config.cost_free_steps,
        rampup_steps=config.cost_rampup_steps,
    )
    cost = c_eff * query_counts.to(discovery.dtype) / denom
    step_rewards = torch.where(has_gt.unsqueeze(1), discovery - cost, torch.zeros_like(discovery))
    discovery = discovery * has_gt.unsqueeze(1)
    return ExplorationRewards(step_rewards, discovery, new, counts, c_eff)


def final_answer_reward(
    f1: torch.Tensor, format_ok: torch.Tensor, *, weight: float = 1.0, format_penalty: float = 0.0
) -> torch.Tensor:
    """``[B]``: ``w_F·F1`` for well-formed answers, ``−format_penalty`` for format errors (float32, or
    float64 for float64 scores)."""
    f1 = f1 if f1.dtype == torch.float64 else f1.float()
    ok = format_ok.to(torch.bool).to(f1.device)
    return torch.where(ok, weight * f1, torch.full_like(f1, -float(format_penalty)))


def outcome_reward(
    score: torch.Tensor,
    format_ok: torch.Tensor,
    config: SpaderRewardConfig,
    *,
    cost_coefficient: float = 0.0,
    num_gt: torch.Tensor | None = None,
    query_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B]`` the outcome term every method pays on its answer step: the final-answer reward on
    ``score`` (:func:`final_answer_reward` with ``w_F`` and the format penalty of ``config``) minus the
    trajectory's tool cost ``c_eff·ΣCount/|GT|`` (rows without gold entities pay none).

    Methods that charge the tool cost per step (SPADER) pass ``cost_coefficient=0``;
    ``num_gt [B]`` and ``query_counts [B, S]`` are needed only when it is not 0.
    """
    final = final_answer_reward(
        score, format_ok, weight=config.final_answer_weight, format_penalty=config.format_penalty
    )
    if cost_coefficient == 0:
        return final
    if num_gt is None or query_counts is None:
        raise ValueError("a tool cost on the outcome needs num_gt and query_counts")
    gt = num_gt.float()
    cost = cost_coefficient * query_counts.float().sum(dim=1) / gt.clamp(min=1)
    return final - torch.where(gt > 0, cost, torch.zeros_like(cost))


@dataclass(frozen=True)
class SpaderRewards:
    """Token- and step-level SPADER rewards of one batch.

    Attributes:
        token_rewards: float ``[B, T]``; step rewards on step anchors, the final term on the last anchor.
        step_rewards: float ``[B, S]``; the same values on the step axis.
        final: float ``[B]``; the final-answer term.
        exploration: :class:`ExplorationRewards` (``None`` when exploration is disabled).
        layout: the :class:`~spader_pipeline.algorithms.steps.StepLayout` used.
    """

    token_rewards: torch.Tensor
    step_rewards: torch.Tensor
    final: torch.Tensor
    exploration: ExplorationRewards | None
    layout: StepLayout


def spader_rewards(
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    *,
    f1: torch.Tensor,
    format_ok: torch.Tensor,
    global_step: int,
    config: SpaderRewardConfig = SpaderRewardConfig(),
    found: torch.Tensor | None = None,
    num_gt: torch.Tensor | None = None,
    query_counts: torch.Tensor | None = None,
    layout: StepLayout | None = None,
) -> SpaderRewards:
    """Assemble SPADER's token-level rewards for a batch (both trainers call this).

    Args:
        response_mask: ``[B, T]``; steps are its maximal runs of 1s (:func:`segment_steps`).
        index: ``[B]`` prompt-group labels.
        f1, format_ok: ``[B]`` final-answer F1 and format validity.
        global_step: the trainer's current step.
        found: bool ``[B, S', E]`` discoveries per step (from :func:`discover_entities`); step ``t`` of
            ``found`` is the ``t``-th model run. Extra steps beyond the response's runs are ignored.
        num_gt: ``[B]`` distinct gold entities; query_counts: ``[B, S']`` executed queries per step.
    """
    layout = layout if layout is not None else segment_steps(response_mask)
    bsz, length = response_mask.shape
    width = layout.max_steps
    final = outcome_reward(f1, format_ok, config)  # the tool cost is charged per step here
    step = torch.zeros((bsz, width), dtype=torch.float32)
    exploration = None
    if config.enable_exploration and found is not None and width:
        if num_gt is None or query_counts is None:
            raise ValueError("exploration needs num_gt and query_counts along with found")
        k = min(width, found.shape[1])
        f = torch.zeros((bsz, width, found.shape[2]), dtype=torch.bool)
        f[:, :k] = found[:, :k]
        q = torch.zeros((bsz, width), dtype=torch.float32)
        q[:, : min(width, query_counts.shape[1])] = query_counts[:, :width].float()
        exploration = exploration_step_rewards(f, index, num_gt, q, global_step=global_step, config=config)
        step = exploration.step_rewards
    token = place_on_anchors(step, final, layout, length)
    return SpaderRewards(token, gather_steps(token, layout), final, exploration, layout)
