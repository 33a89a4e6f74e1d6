"""GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300).

A torch-only, vectorised twin of verl's ``compute_grpo_outcome_advantage`` (verl 0.9.1): the ``grpo``
method's estimator in :mod:`spader_pipeline.algorithms.methods`, which the native trainer runs. On
verl the ``grpo`` method keeps verl's own estimator; ``tests/verl_plugin/test_spader_reward_batch.py``
checks both agree, and ``tests/algorithms/test_methods_cross_backend.py`` the whole GRPO path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._groups import group_index

__all__ = ["grpo_outcome_advantage", "grpo_scalar_advantage"]


def grpo_scalar_advantage(
    scores: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> torch.Tensor:
    """Group-normalised scalar scores ``[B]`` → advantages ``[B]``.

    ``A_i = (s_i − mean_g) / (std_g + ε)`` with the unbiased (N−1) std; a singleton group uses mean 0
    and std 1 (verl's convention). ``norm_adv_by_std=False`` gives Dr.GRPO
    (https://arxiv.org/abs/2503.20783): ``A_i = s_i − mean_g``.
    """
    groups = group_index(index, device=scores.device)
    single = (groups.sizes == 1)[groups.ids]
    mean = torch.where(single, torch.zeros_like(scores), groups.mean(scores))
    if not norm_adv_by_std:
        return scores - mean
    std = torch.where(single, torch.ones_like(scores), groups.std(scores, unbiased=True))
    return (scores - mean) / (std + epsilon)


@torch.no_grad()
def grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO on the summed token rewards, broadcast over model tokens.

    Args:
        token_level_rewards: ``[B, T]``; the outcome score is the row sum.
        response_mask: ``[B, T]``; 1 on tokens that receive the advantage.
        index: ``[B]`` group labels (verl's ``uid``).
    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and identical (no critic).
    """
    scores = token_level_rewards.sum(dim=-1)
    adv = grpo_scalar_advantage(scores, index, epsilon=epsilon, norm_adv_by_std=norm_adv_by_std)
    out = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return out, out
