"""Register the project's advantage estimators in verl's registry: ``spa``, ``calibadv``, ``tspo``.

verl 0.9's ``ray_trainer.compute_advantage`` calls a registered estimator with ``token_level_rewards``,
``response_mask``, ``config`` (the ``algorithm`` config) and ``index`` (= ``uid``) only, so every
per-step signal travels in ``token_level_rewards`` on step anchors, as written by the ``spader``
reward manager (:mod:`.reward_manager`):

* ``spa``: step rewards on each step's last token (SPADER layout);
* ``calibadv``: outcome on the last model token, step scores ``q_t`` on search-step anchors;
* ``tspo``: outcome on the last model token, the latent reward on the first-occurrence step.

Options are read from ``algorithm.<name>`` (e.g. ``+algorithm.calibadv.target_ratio=1.0``), defaulting
to the papers' values. ``grpo`` stays verl's own implementation.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_adv_est

from spader_pipeline.algorithms.advantages import calibadv_advantage, spa_advantage, tspo_advantage
from spader_pipeline.algorithms.steps import gather_steps, segment_steps

__all__ = ["calibadv_estimator", "spa_estimator", "split_outcome_and_steps", "tspo_estimator"]


def _option(config: Any, section: str, key: str, default: Any) -> Any:
    if config is None:
        return default
    block = config.get(section, None) if hasattr(config, "get") else getattr(config, section, None)
    if block is None:
        return default
    value = block.get(key, None) if hasattr(block, "get") else getattr(block, key, None)
    return default if value is None else value


def _gamma(config: Any) -> float:
    value = config.get("gamma", None) if hasattr(config, "get") else getattr(config, "gamma", None)
    return 1.0 if value is None else float(value)


def split_outcome_and_steps(token_level_rewards: torch.Tensor, response_mask: torch.Tensor):
    """Read the (outcome, search-step values, layout) convention of the calibadv/tspo layouts.

    Returns ``outcome [B]`` (value on the last step's anchor), ``step_values [B, S]`` with the answer
    step zeroed, and the :class:`~spader_pipeline.algorithms.steps.StepLayout`.
    """
    layout = segment_steps(response_mask)
    steps = gather_steps(token_level_rewards.float(), layout)
    if layout.max_steps == 0:
        return token_level_rewards.new_zeros(token_level_rewards.shape[0]).float(), steps, layout
    last = (layout.num_steps - 1).clamp(min=0)
    outcome = steps.gather(1, last.unsqueeze(1)).squeeze(1) * (layout.num_steps > 0)
    search = steps.scatter(1, last.unsqueeze(1), 0.0)
    return outcome, search, layout


@register_adv_est("spa")
def spa_estimator(token_level_rewards, response_mask, config=None, index=None, **kwargs):
    """SPADER's step-wise peer advantage (spec §4.1); ``γ = algorithm.gamma``, ``ε = algorithm.spa.epsilon``."""
    if index is None:
        raise ValueError("the spa estimator needs the batch's uid (index)")
    return spa_advantage(
        token_level_rewards,
        response_mask,
        index,
        gamma=_gamma(config),
        epsilon=float(_option(config, "spa", "epsilon", 1e-6)),
    )


@register_adv_est("calibadv")
def calibadv_estimator(token_level_rewards, response_mask, config=None, index=None, **kwargs):
    """CalibAdv (arXiv 2604.18235); options ``algorithm.calibadv.{target_ratio, epsilon, soft_penalty, rebalance_answer}``."""
    if index is None:
        raise ValueError("the calibadv estimator needs the batch's uid (index)")
    outcome, q, layout = split_outcome_and_steps(token_level_rewards, response_mask)
    return calibadv_advantage(
        outcome,
        response_mask,
        index,
        q,
        target_ratio=float(_option(config, "calibadv", "target_ratio", 1.0)),
        epsilon=float(_option(config, "calibadv", "epsilon", 1e-6)),
        soft_penalty=bool(_option(config, "calibadv", "soft_penalty", True)),
        rebalance_answer=bool(_option(config, "calibadv", "rebalance_answer", True)),
        layout=layout,
    )


@register_adv_est("tspo")
def tspo_estimator(token_level_rewards, response_mask, config=None, index=None, **kwargs):
    """TSPO/FOLR — PROPOSAL (spec §2.2; only the paper's abstract is public).

    Options ``algorithm.tspo.{latent_reward, add_turn_term, epsilon}``.
    """
    if index is None:
        raise ValueError("the tspo estimator needs the batch's uid (index)")
    outcome, marks, layout = split_outcome_and_steps(token_level_rewards, response_mask)
    has = (marks > 0).any(dim=1)
    k_star = torch.where(has, (marks > 0).long().argmax(dim=1), torch.full_like(has, -1, dtype=torch.long))
    return tspo_advantage(
        outcome,
        k_star,
        response_mask,
        index,
        latent_reward=float(_option(config, "tspo", "latent_reward", 0.5)),
        add_turn_term=bool(_option(config, "tspo", "add_turn_term", True)),
        epsilon=float(_option(config, "tspo", "epsilon", 1e-6)),
        layout=layout,
    )
