"""CalibAdv (arXiv 2604.18235): silver-document step scores calibrate the GRPO advantage.

Reward layout: the outcome ``F1 × format`` (our outcome term with ``w_F = 1``, no format penalty)
on the answer step, each search step's silver-document score ``q_t`` on its last token. Estimator:
``calibadv``, GRPO's outcome advantage with negative search-step advantages softened by ``1 − q_t``
and the answer component rebalanced per group. Defaults are those of its released training script.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..advantages import calibadv_advantage, calibadv_step_scores
from .base import (
    Method,
    MethodRewards,
    cost_coefficient,
    outcome,
    place_on_anchors,
    register_method,
    split_outcome_and_steps,
)

__all__ = ["CALIBADV", "CalibAdvOptions"]


@dataclass(frozen=True)
class CalibAdvOptions:
    """CalibAdv (arXiv 2604.18235); defaults from its released training script."""

    silver_threshold: float = 0.7
    """outcome a format-valid rollout needs for its documents to join the group's silver set"""
    think_similarity: float = 0.5
    """word-level similarity above which a turn's reasoning repeats an earlier one (score voided)"""
    max_repeated_docs: int = 1
    """a turn repeating more than this many earlier documents is voided"""
    target_ratio: float = 1.0
    """λ of the answer rebalancing (positive answer mass = |negative| / λ)"""
    epsilon: float = 1e-6
    """GRPO's std epsilon"""
    soft_penalty: bool = True
    """soften negative advantages of search turns by ``1 − q_t``"""
    rebalance_answer: bool = True
    """rebalance positive vs negative advantages on the answer component per group"""


def calibadv_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    c_eff = cost_coefficient(global_step, reward)
    final = outcome(inputs.f1, inputs, reward, c_eff)
    answer_term = outcome(inputs.f1, inputs, reward, 0.0)  # silver documents: the answer's quality, cost-free
    docs = inputs.step_documents or [[] for _ in range(mask.shape[0])]
    searches = (layout.num_steps - 1).clamp(min=0).tolist()
    scores = calibadv_step_scores(
        [[list(d) for d in list(row)[:n]] for row, n in zip(docs, searches, strict=True)],
        answer_term.tolist(),
        inputs.format_ok.tolist(),
        index,
        thinks=[list(t) for t in inputs.step_thinks] if inputs.step_thinks is not None else None,
        silver_threshold=options.silver_threshold,
        think_similarity=options.think_similarity,
        max_repeated_docs=options.max_repeated_docs,
        num_steps=layout.max_steps,
    )
    token = place_on_anchors(scores, final, layout, mask.shape[1])
    return MethodRewards(token, final, torch.zeros_like(final), c_eff)


def calibadv_method_advantage(rewards, mask, index, options: CalibAdvOptions, layout):
    final, q, layout = split_outcome_and_steps(rewards, mask, layout)
    return calibadv_advantage(
        final,
        mask,
        index,
        q,
        target_ratio=options.target_ratio,
        epsilon=options.epsilon,
        soft_penalty=options.soft_penalty,
        rebalance_answer=options.rebalance_answer,
        layout=layout,
    )


CALIBADV = register_method(
    Method(
        "calibadv", "calibadv", CalibAdvOptions, calibadv_rewards, calibadv_method_advantage,
        paper="CalibAdv, arXiv 2604.18235", needs_step_documents=True, needs_step_thinks=True,
    )
)
