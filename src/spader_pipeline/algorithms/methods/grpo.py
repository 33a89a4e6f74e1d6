"""GRPO (DeepSeekMath, arXiv 2402.03300): the outcome on the answer step, group-normalised.

Reward layout: the outcome ``w_F·F1`` (``−format_penalty`` on a format error) minus the tool cost
``c_eff·ΣCount/|GT|`` on the answer step's last token. Estimator: ``grpo``, the outcome's group
z-score broadcast over the model tokens (on verl, verl's own ``grpo``, equal to this one:
``tests/algorithms/test_methods_cross_backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..advantages import grpo_outcome_advantage
from .base import Method, MethodRewards, cost_coefficient, outcome, place_on_anchors, register_method

__all__ = ["GRPO", "GrpoOptions"]


@dataclass(frozen=True)
class GrpoOptions:
    """GRPO (DeepSeekMath, arXiv 2402.03300)."""

    norm_adv_by_std_in_grpo: bool = True
    """divide by the group std (``False``: Dr.GRPO, arXiv 2503.20783)"""


def grpo_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    c_eff = cost_coefficient(global_step, reward)
    final = outcome(inputs.f1, inputs, reward, c_eff)
    token = place_on_anchors(torch.zeros((mask.shape[0], layout.max_steps)), final, layout, mask.shape[1])
    return MethodRewards(token, final, torch.zeros_like(final), c_eff)


def grpo_advantage(rewards, mask, index, options: GrpoOptions, layout):
    return grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=options.norm_adv_by_std_in_grpo)


GRPO = register_method(
    Method("grpo", "grpo", GrpoOptions, grpo_rewards, grpo_advantage, paper="DeepSeekMath, arXiv 2402.03300",
           default_run=True)
)
