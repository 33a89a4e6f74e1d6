"""SPADER (arXiv 2606.00593): diversity-aware exploration reward + step-wise peer advantage (SPA).

Reward layout: each step's exploration reward (novelty-weighted first discoveries minus its tool
cost ``c_eff·Count_t/|GT|``) on the step's last token, the outcome ``w_F·F1`` added on the answer
step (:func:`~spader_pipeline.algorithms.rewards.spader_rewards`). Estimator: ``spa``, the
discounted step returns standardised across the prompt group, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..advantages import spa_advantage
from ..rewards import spader_rewards
from .base import Method, MethodRewards, cost_coefficient, register_method

__all__ = ["SPADER", "SpaOptions"]


@dataclass(frozen=True)
class SpaOptions:
    """SPADER's step-wise peer advantage (arXiv 2606.00593)."""

    gamma: float = 0.9
    """step discount of the returns-to-go (0.9 in all SPADER paper configs)"""
    epsilon: float = 1e-6
    """added to the group variance before the square root"""


def spader_method_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    out = spader_rewards(
        mask,
        index,
        f1=inputs.f1,
        format_ok=inputs.format_ok,
        global_step=global_step,
        config=reward,
        found=inputs.found,
        num_gt=inputs.num_gt,
        query_counts=inputs.query_counts,
        layout=layout,
    )
    if out.exploration is not None:
        discovery = (out.exploration.discovery * layout.step_mask).sum(dim=1)
        c_eff = out.exploration.cost_coefficient
    else:
        discovery, c_eff = torch.zeros(mask.shape[0]), cost_coefficient(global_step, reward)
    return MethodRewards(out.token_rewards, out.token_rewards.sum(dim=1), discovery, c_eff)


def spader_advantage(rewards, mask, index, options: SpaOptions, layout):
    return spa_advantage(rewards, mask, index, gamma=options.gamma, epsilon=options.epsilon, layout=layout)


SPADER = register_method(
    Method(
        "spader", "spa", SpaOptions, spader_method_rewards, spader_advantage, paper="SPADER, arXiv 2606.00593",
        exploration=True, tool_round_cost=0.01, default_run=True,
    )
)
