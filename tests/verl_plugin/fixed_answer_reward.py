"""The native learning test's reward, in verl's reward path: the ``fixed_answer`` reward manager, and
GRPO's estimator with its advantages zeroed or flipped (``grpo_zeroed``, ``grpo_flipped``).

verl's reward workers and trainer import this module through ``VERL_USE_EXTERNAL_MODULES`` (as a user's
own reward module is imported). The reward is ``tests/native/test_native_learns.py``'s: a trajectory
earns the share of its model tokens that are tokens of the fixed answer; it replaces the answer score
(F1, every answer counted well formed) where the ``spader`` manager scores a sample, so the method's
reward layout, its estimator, verl's policy loss and optimiser run as in a real run.
"""

from __future__ import annotations

import json

import torch
from verl.experimental.reward_loop.reward_manager import register
from verl.trainer.ppo.core_algos import (
    ADV_ESTIMATOR_REGISTRY,
    compute_grpo_outcome_advantage,
    register_adv_est,
)

from spader_pipeline.verl_plugin.reward_manager import PAYLOAD_KEY, SpaderRewardManager

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


def _scaled_grpo(scale: float):
    def estimator(token_level_rewards, response_mask, index, config=None, **kwargs):
        advantages, returns = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, config=config)
        return advantages * scale, returns * scale

    return estimator


for _name, _scale in (("grpo_zeroed", 0.0), ("grpo_flipped", -1.0)):
    if _name not in ADV_ESTIMATOR_REGISTRY:
        register_adv_est(_name)(_scaled_grpo(_scale))
