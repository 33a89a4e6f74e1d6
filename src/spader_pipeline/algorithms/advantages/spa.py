"""SPA — SPADER's Step-wise Peer Advantage (arXiv 2606.00593; reference ``masked_step_grpo``; docs/algorithms.md).

For trajectory ``i`` with decision steps ``t = 0..K_i−1`` (maximal runs of model tokens) and step
reward ``r_{i,t}`` read at each step's anchor (its last token):

* return-to-go ``G_{i,t} = Σ_{k=t}^{K_i−1} γ^{k−t} r_{i,k}``, and ``G_{i,t} = 0`` for ``t ≥ K_i``;
* per prompt group and step index ``t``, over **all** members (finished trajectories contribute 0):
  ``μ_t = mean_j G_{j,t}``, ``Var_t = mean_j (G_{j,t} − μ_t)²`` (population variance);
* ``A_{i,t} = (G_{i,t} − μ_t) / sqrt(Var_t + ε)`` for real steps, 0 otherwise;
* every model token of step ``t`` receives ``A_{i,t}``; observation and padding tokens get 0.

Consequences kept on purpose for fidelity to the SPADER reference code: singleton groups give 0, steps are aligned
by index across peers, a lone long trajectory gets ``±sqrt(n−1)`` on its late steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..steps import StepLayout, gather_steps, segment_steps, spread_over_steps
from ._groups import group_index

__all__ = ["discounted_step_returns", "spa_advantage", "spa_step_advantage"]


def discounted_step_returns(
    step_rewards: torch.Tensor, step_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``[B, S]`` step rewards → ``[B, S]`` returns-to-go ``G_t = Σ_{k≥t} γ^{k−t} r_k``, zero on padded steps.

    Equals the reference recursion ``run = r_t + γ·run; G_t = run; run ← run·m_t`` because real steps
    form a prefix of each row: one ``[B, S] @ [S, S]`` product instead of a loop over steps.
    """
    m = step_mask.to(step_rewards.dtype)
    width = step_rewards.shape[1]
    k = torch.arange(width, device=step_rewards.device)
    power = (k.unsqueeze(1) - k.unsqueeze(0)).to(torch.float64)  # [k, t] = k − t
    discount = torch.where(
        power >= 0, torch.pow(torch.tensor(float(gamma), dtype=torch.float64), power.clamp(min=0)), 0.0
    )
    returns = (step_rewards.double() * m.double()) @ discount
    return returns.to(step_rewards.dtype) * m


def spa_step_advantage(
    step_rewards: torch.Tensor,
    step_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    *,
    gamma: float = 1.0,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-level SPA: ``[B, S]`` rewards and mask → ``(advantages [B, S], returns [B, S])``.

    The group statistics run in float64 (``[B, S]`` is small): with ``Var_t`` near ``ε``, float32
    centring errors would be amplified by ``1/sqrt(Var_t + ε)``.
    """
    returns = discounted_step_returns(step_rewards.double(), step_mask, gamma)
    groups = group_index(index, device=step_rewards.device)
    mu = groups.mean(returns)
    centred = returns - mu
    var = groups.mean(centred * centred)
    adv = centred / torch.sqrt(var + epsilon)
    adv = adv * step_mask.to(adv.dtype)
    return adv.to(step_rewards.dtype), returns.to(step_rewards.dtype)


@torch.no_grad()
def spa_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    *,
    gamma: float = 1.0,
    epsilon: float = 1e-6,
    layout: StepLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level SPA.

    Args:
        token_level_rewards: ``[B, T]``; step rewards are read at each step's anchor only.
        response_mask: ``[B, T]``; 1 on model tokens, 0 on observations and padding.
        index: ``[B]`` group labels (verl's ``uid``).
        gamma: step discount (the SPADER configs use 0.9).
        epsilon: added to the variance before the square root (reference: 1e-6).
        layout: precomputed :func:`segment_steps` result (optional).
    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32; zero outside model tokens.
    """
    rewards = token_level_rewards.float()
    layout = layout if layout is not None else segment_steps(response_mask)
    if layout.max_steps == 0:
        zeros = torch.zeros_like(rewards)
        return zeros, zeros.clone()
    step_rewards = gather_steps(rewards, layout)
    adv, ret = spa_step_advantage(step_rewards, layout.step_mask, index, gamma=gamma, epsilon=epsilon)
    return spread_over_steps(adv, layout), spread_over_steps(ret, layout)
