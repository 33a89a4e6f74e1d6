"""The native learning test's reward, in verl's reward path: the ``fixed_answer`` reward manager, and
two control methods, GRPO with its advantages zeroed or flipped (``grpo_zeroed``, ``grpo_flipped``).

A control is a method of its own, registered as a user's method is (GRPO's reward layout and options,
its estimator scaled): on verl a method is one key (``spader_method``), which sets the estimator and
the reward layout together. verl's reward workers and trainer import this module through
``VERL_USE_EXTERNAL_MODULES`` (as a user's own reward module is imported) and register the controls
when :data:`WORKER_FLAG` is set in their environment; the test registers them only while it runs
(``registered``), so the registry other tests see holds the project's methods. The reward is ``tests/native/test_native_learns.py``'s: a trajectory
earns the share of its model tokens that are tokens of the fixed answer; it replaces the answer score
(F1, every answer counted well formed) where the ``spader`` manager scores a sample, so the method's
reward layout, its estimator, verl's policy loss and optimiser run as in a real run.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from verl.experimental.reward_loop.reward_manager import register

from spader_pipeline.algorithms.methods import Method, get_method, register_method
from spader_pipeline.verl_plugin.reward_manager import PAYLOAD_KEY, SpaderRewardManager

WORKER_FLAG = "SPADER_TEST_REGISTER_CONTROLS"  # set only in the Ray workers of a run that trains a control

FIXED_ANSWER = '<answer>["Ghana"]</answer>'
REWARD_NAME = "fixed_answer"


def fixed_answer_share(response_ids: torch.Tensor, response_mask: torch.Tensor, answer_ids: torch.Tensor) -> float:
    """The share of the model tokens (``response_mask`` 1) of one response that are fixed-answer tokens."""
    hits = torch.isin(response_ids, answer_ids).float() * response_mask.float()
    return float(hits.sum() / response_mask.float().sum().clamp(min=1))


@register(REWARD_NAME)
class FixedAnswerRewardManager(SpaderRewardManager):
    """``spader``'s manager with the fixed-answer share as the answer score of every sample."""

    def score_sample(self, data):
        scored = super().score_sample(data)
        item = data[-1]
        responses = item.batch["responses"]
        valid = int(item.batch["attention_mask"][-responses.shape[-1]:].sum())
        mask = item.batch["response_mask"][:valid] if "response_mask" in item.batch.keys() else torch.ones(valid)
        answer = torch.tensor(self.tokenizer.encode(FIXED_ANSWER, add_special_tokens=False))
        share = fixed_answer_share(responses[:valid], mask, answer)
        payload = json.loads(scored["reward_extra_info"][PAYLOAD_KEY])
        payload.update(f1=share, format_ok=True, final=share)
        scored["reward_extra_info"][PAYLOAD_KEY] = json.dumps(payload)
        scored["reward_extra_info"]["fixed_answer_share"] = share
        scored["reward_score"] = share
        return scored


def scaled_grpo(name: str, scale: float) -> Method:
    """GRPO under the name ``name`` (its estimator's name too), its advantages and returns times ``scale``."""
    grpo = get_method("grpo")

    def advantage(rewards, mask, index, options, layout):
        advantages, returns = grpo.advantage(rewards, mask, index, options, layout)
        return advantages * scale, returns * scale

    return dataclasses.replace(grpo, name=name, estimator=name, advantage=advantage, default_run=False,
                               paper=f"GRPO, advantages × {scale:g} (a learning control)")


CONTROLS = (scaled_grpo("grpo_zeroed", 0.0), scaled_grpo("grpo_flipped", -1.0))

if os.environ.get(WORKER_FLAG) == "1":  # a verl worker of a run that trains a control
    for _control in CONTROLS:
        register_method(_control)
