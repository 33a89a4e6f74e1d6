"""TSPO / FOLR — **PROPOSAL**, not a reproduction (arXiv 2601.22776).

Only the abstract of "Breaking the Double Homogenization Dilemma in Multi-turn Search Policy
Optimization" is public; its code is not. This module implements our proposed design (built on
Search-R1's outcome and retrieval check; docs/algorithms.md), every constant a tunable flagged UNVERIFIED:

* **First-Occurrence Latent Reward**: trajectory ``i`` earns ``ℓ_i = α·1[k*_i exists]`` at the step
  ``k*_i`` whose observation first contains a gold answer (the reward side finds ``k*``; see
  :func:`spader_pipeline.algorithms.rewards.first_occurrence_steps`).
* **Composition-dependent advantages** per prompt group, from outcome rewards ``R`` (EM or F1):
  - *mixed* group (not all ``R`` equal): trajectory-level GRPO on ``R`` for every model token, plus
    (``add_turn_term``) the turn-level term ``(ℓ_i − mean ℓ)/(std ℓ + ε)`` on steps ``≤ k*_i``;
  - *homogeneous* group (all ``R`` equal — GRPO's vanishing-advantage case): only the turn-level term,
    on the retrieval stage (steps ``≤ k*_i``, or every search step when there is no ``k*_i``); the
    answer-stage tokens get 0.
  GRPO normalisation throughout (unbiased std, ε = 1e-6, singleton → mean 0 / std 1).

Verify against the paper's code before claiming to reproduce TSPO.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..steps import StepLayout, segment_steps, spread_over_steps
from ._groups import group_index
from .grpo import grpo_scalar_advantage

__all__ = ["tspo_advantage"]


@torch.no_grad()
def tspo_advantage(
    outcome_rewards: torch.Tensor,
    first_occurrence: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    *,
    latent_reward: float = 0.5,
    add_turn_term: bool = True,
    epsilon: float = 1e-6,
    homogeneous_atol: float = 1e-8,
    layout: StepLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level TSPO advantages (PROPOSAL, see module docstring).

    Args:
        outcome_rewards: ``[B]`` outcome reward ``R_i``.
        first_occurrence: long ``[B]``, step index ``k*_i`` (``-1`` when gold never appeared).
        response_mask: ``[B, T]`` model-token mask.
        index: ``[B]`` group labels.
        latent_reward: α of the latent reward (UNVERIFIED; 0.5 suggested).
        add_turn_term: in mixed groups, add the turn-level term on steps ``≤ k*``.
        homogeneous_atol: outcome spread under which a group counts as homogeneous.
    Returns:
        ``(advantages, returns)`` ``[B, T]``; ``returns`` holds ``R_i`` on model tokens.
    """
    layout = layout if layout is not None else segment_steps(response_mask)
    r = outcome_rewards.float()
    k_star = first_occurrence.long().to(r.device)
    has_k = k_star >= 0
    latent = latent_reward * has_k.float()
    groups = group_index(index, device=r.device)
    r_max = torch.full((groups.num_groups,), -float("inf"), device=r.device).scatter_reduce(
        0, groups.ids, r, "amax"
    )
    r_min = torch.full((groups.num_groups,), float("inf"), device=r.device).scatter_reduce(
        0, groups.ids, r, "amin"
    )
    homogeneous = ((r_max - r_min) <= homogeneous_atol)[groups.ids]

    traj_adv = grpo_scalar_advantage(r, index, epsilon=epsilon)
    turn_adv = grpo_scalar_advantage(latent, index, epsilon=epsilon)

    width = layout.max_steps
    mask = (response_mask != 0).float()
    if width == 0:
        zeros = torch.zeros_like(mask)
        return zeros, zeros.clone()
    steps = torch.arange(width, device=r.device).unsqueeze(0)
    # retrieval stage: steps up to k*, or every search step (all but the answer step) without k*
    stage_end = torch.where(has_k, k_star, layout.num_steps - 2).unsqueeze(1)
    retrieval = (steps <= stage_end) & layout.step_mask
    mixed_steps = traj_adv.unsqueeze(1).expand(-1, width)
    if add_turn_term:
        mixed_steps = mixed_steps + turn_adv.unsqueeze(1) * (retrieval & has_k.unsqueeze(1))
    homog_steps = turn_adv.unsqueeze(1) * retrieval
    step_adv = torch.where(homogeneous.unsqueeze(1), homog_steps, mixed_steps) * layout.step_mask
    adv = spread_over_steps(step_adv, layout) * mask
    returns = r.unsqueeze(1) * mask
    return adv, returns
