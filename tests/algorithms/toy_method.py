"""A toy fifth method, defined here and nowhere else (the worked example of docs/algorithms.md,
"Adding a method"): the shared outcome term on the answer step (as GRPO), and REINFORCE with the
group-mean baseline as its estimator, ``A_i = scale · (R_i − mean_group R)`` on every model token,
under the estimator name ``toy_baseline``.

It is registered only while a test needs it (``registered(TOY)``), so the registry other tests see
holds the four project methods. verl's Ray workers, which score the rewards in their own processes,
import this module through ``VERL_USE_EXTERNAL_MODULES`` (as a user's own method module would be),
and register it there when :data:`WORKER_FLAG` is set in their environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from spader_pipeline.algorithms.advantages._groups import group_index
from spader_pipeline.algorithms.methods import Method, MethodRewards, register_method, split_outcome_and_steps
from spader_pipeline.algorithms.methods.base import cost_coefficient, outcome, place_on_anchors

WORKER_FLAG = "SPADER_TEST_REGISTER_TOY"  # set only in the Ray workers of a verl run that trains the toy


@dataclass(frozen=True)
class ToyOptions:
    """The toy method's options."""

    scale: float = 1.0
    """multiplies the advantage"""


def toy_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    """The outcome (F1, format penalty, tool cost on the outcome) on the answer step's last token."""
    c_eff = cost_coefficient(global_step, reward)
    final = outcome(inputs.f1, inputs, reward, c_eff)
    token = place_on_anchors(torch.zeros((mask.shape[0], layout.max_steps)), final, layout, mask.shape[1])
    return MethodRewards(token, final, torch.zeros_like(final), c_eff)


CALLS: list[int] = []  # batch sizes the estimator saw (in this process)


def toy_advantage(rewards, mask, index, options: ToyOptions, layout):
    """``scale · (R_i − mean_group R)`` broadcast over the model tokens."""
    CALLS.append(rewards.shape[0])
    final, _, layout = split_outcome_and_steps(rewards, mask, layout)
    groups = group_index(index)
    adv = options.scale * (final - groups.mean(final))
    token = adv.unsqueeze(1) * mask.float()
    return token, token


TOY = Method("toy", "toy_baseline", ToyOptions, toy_rewards, toy_advantage, paper="REINFORCE, group-mean baseline")

if os.environ.get(WORKER_FLAG) == "1":  # a verl worker of a run that trains the toy
    register_method(TOY)
