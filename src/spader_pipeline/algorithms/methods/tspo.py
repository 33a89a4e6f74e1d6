"""TSPO / FOLR (arXiv 2601.22776), a proposal design: only the paper's abstract is public.

Reward layout: the outcome on the answer step, built on exact match (the Search-R1 outcome the
design builds on; ``TspoOptions.outcome`` switches to F1), and the latent reward ``α`` on the first
search step whose documents hold a gold entity (the first occurrence ``k*``; the answer step is not
searched). Estimator: ``tspo``, GRPO's outcome advantage plus, in mixed groups, a turn-level term on
the steps up to ``k*`` (docs/algorithms.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..advantages import tspo_advantage
from ..rewards import first_occurrence_steps
from .base import (
    Method,
    MethodRewards,
    cost_coefficient,
    fit_steps,
    outcome,
    place_on_anchors,
    register_method,
    search_steps_only,
    split_outcome_and_steps,
)

__all__ = ["TSPO", "TspoOptions"]


@dataclass(frozen=True)
class TspoOptions:
    """TSPO / FOLR (arXiv 2601.22776), proposal design (docs/algorithms.md)."""

    latent_reward: float = 0.5
    """α of the first-occurrence latent reward (not in the public abstract: our choice)"""
    add_turn_term: bool = True
    """in mixed groups, add the turn-level term on steps up to the first occurrence"""
    epsilon: float = 1e-6
    """GRPO's std epsilon"""
    outcome: str = "exact_match"
    """outcome score: ``exact_match`` (the design's Search-R1 outcome) or ``f1``"""

    def __post_init__(self) -> None:
        if self.outcome not in ("exact_match", "f1"):
            raise ValueError(f"tspo outcome must be 'exact_match' or 'f1', got {self.outcome!r}")
        if self.latent_reward <= 0:
            raise ValueError("tspo latent_reward must be > 0 (its position marks the first occurrence)")


def tspo_answer_score(options: TspoOptions, *, f1, exact_match):
    """Exact match unless ``options.outcome`` says ``f1``."""
    return exact_match if options.outcome == "exact_match" else f1


def tspo_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    width = layout.max_steps
    c_eff = cost_coefficient(global_step, reward)
    score = tspo_answer_score(options, f1=inputs.f1, exact_match=inputs.exact_match)
    final = outcome(score.float(), inputs, reward, c_eff)
    marks = torch.zeros((mask.shape[0], width))
    if width:
        k_star = first_occurrence_steps(search_steps_only(fit_steps(inputs.found, width), layout))
        rows = (k_star >= 0).nonzero().flatten()
        marks[rows, k_star[rows]] = options.latent_reward
    token = place_on_anchors(marks, final, layout, mask.shape[1])
    return MethodRewards(token, final, torch.zeros_like(final), c_eff)


def tspo_method_advantage(rewards, mask, index, options: TspoOptions, layout):
    final, marks, layout = split_outcome_and_steps(rewards, mask, layout)
    has = (marks > 0).any(dim=1)
    k_star = torch.where(has, (marks > 0).long().argmax(dim=1), torch.full_like(has, -1, dtype=torch.long))
    return tspo_advantage(
        final,
        k_star,
        mask,
        index,
        latent_reward=options.latent_reward,
        add_turn_term=options.add_turn_term,
        epsilon=options.epsilon,
        layout=layout,
    )


TSPO = register_method(
    Method(
        "tspo", "tspo", TspoOptions, tspo_rewards, tspo_method_advantage,
        paper="TSPO, arXiv 2601.22776 (proposal design)", answer_score=tspo_answer_score,
    )
)
