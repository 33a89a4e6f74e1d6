"""The native loop learns (issue 42, item 1): on a reward one behaviour earns, the tiny model's mean
training reward rises through the real ``train_native`` loop by a margin noise cannot give; with the
advantages zeroed or their sign flipped, it does not.

**The reward.** A trajectory earns the share of its model tokens that are tokens of the fixed answer
``<answer>["Ghana"]</answer>`` (6 of the 400-token vocabulary): about 0.012 for the untrained
model, 1.0 for a policy that writes nothing else. It replaces the answer score (``RewardInputs.f1``,
every answer counted well formed) where the trainer scores a batch, so GRPO's own reward layout,
its group-normalised estimator, verl's PPO loss and AdamW run as in a real run. The method
registry's rewards read no tokens, hence the swap at the trainer's ``compute_advantages`` rather
than a registered test method.

**The check.** ``rise`` = mean reward of the last two steps − that of the first two, over 10 steps
of 2 questions × 8 trajectories, one 16-token turn each, learning rate 2e-2, no KL term, no weight
decay, fp32. Measured (2026-11-26, 2 cores of an AMD EPYC with AVX-512 bf16; seed 0's curve is the
same with 1 and 2 torch threads):

* learning, seeds 0–7: 0.69, 0.52, 0.80, 0.72, 0.06, 0.73, 0.90, 0.75 (seed 4 starts late);
* no learning (advantages × 0, which here equals a learning rate of 0: every gradient is 0),
  seeds 0–7: −0.021 to +0.007;
* advantage sign flipped, seeds 0–3: −0.019 to −0.010 (the reward falls to 0); the sign of
  verl's policy loss flipped instead (a scratch run), seeds 0–2: −0.012, −0.018, −0.017.

The mean rise of seeds 0–2 (0.67) must exceed ``MARGIN`` = 0.15: 7× the largest no-learning
|rise|, and below the mean of any 3 of the 8 learning seeds (smallest 0.42). Zeroed or flipped
advantages must keep it below ``NO_LEARNING_BOUND`` = 0.05, where runs that do not learn lie.

verl runs the same test through its own ``fit()`` and workers on the CPU, with this reward swapped in
through verl's reward path and these constants (``tests/verl_plugin/test_verl_learns.py``, ``make test-verl``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from native_toy import QUESTIONS, TEMPLATE

pytestmark = pytest.mark.slow

FIXED_ANSWER = '<answer>["Ghana"]</answer>'
SEEDS = (0, 1, 2)
STEPS = 10
MARGIN = 0.15
NO_LEARNING_BOUND = 0.05


def fixed_answer_share(batch, answer_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` the share of each trajectory's model tokens that are tokens of the fixed answer."""
    hits = torch.isin(batch.response_ids, answer_ids).float() * batch.response_mask
    return hits.sum(dim=1) / batch.response_mask.sum(dim=1).clamp(min=1)


def reward_rise(rewards: list[float]) -> float:
    """Mean reward of the last two steps minus that of the first two."""
    return (sum(rewards[-2:]) - sum(rewards[:2])) / 2


def train_on_fixed_answer(model_dir, index_dir, run_dir, config, monkeypatch, *, advantage_sign: float) -> list[float]:
    """Run ``train_native`` with the fixed-answer reward in place of the answer score; the
    advantages are multiplied by ``advantage_sign``. Returns ``method_reward/mean`` per step."""
    from transformers import AutoTokenizer

    from spader_pipeline.native import train_native, trainer
    from spader_pipeline.native.batch import compute_advantages
    from spader_pipeline.retrieval import load_retriever
    from spader_pipeline.retrieval.service import LocalSearch

    answer_ids = torch.tensor(AutoTokenizer.from_pretrained(model_dir).encode(FIXED_ANSWER, add_special_tokens=False))

    def fixed_answer_advantages(batch, method, **kwargs):
        score = fixed_answer_share(batch, answer_ids)
        rewards = dataclasses.replace(batch.rewards, f1=score, format_ok=torch.ones_like(batch.rewards.format_ok))
        adv = compute_advantages(dataclasses.replace(batch, rewards=rewards), method, **kwargs)
        return dataclasses.replace(adv, advantages=adv.advantages * advantage_sign)

    monkeypatch.setattr(trainer, "compute_advantages", fixed_answer_advantages)
    result = train_native(config, model_path=model_dir, samples=QUESTIONS, search=LocalSearch(load_retriever(index_dir)),
                          run_dir=run_dir, prompt_template=TEMPLATE)
    return [row["method_reward/mean"] for row in result.history]


@pytest.mark.heavy
@pytest.mark.parametrize("advantage_sign", [1.0, 0.0, -1.0], ids=["advantages", "zeroed", "flipped"])
def test_the_mean_reward_rises_only_when_the_advantages_point_up(tmp_path, native_model_dir, toy_index_dir,
                                                                 tiny_config, monkeypatch, advantage_sign):
    curves = {}
    for seed in SEEDS:
        config = tiny_config(method="grpo", options={}, total_steps=STEPS, prompts_per_step=2, group_size=8,
                             micro_batch_size=16, rollout={"max_turns": 1, "max_response_tokens": 100},
                             max_new_tokens=16, learning_rate=2e-2, weight_decay=0.0, warmup_ratio=0.0, kl_coef=0.0,
                             bf16=False, seed=seed, checkpoint_every=0, log_samples_every=0)
        curves[seed] = train_on_fixed_answer(native_model_dir, toy_index_dir, tmp_path / f"seed{seed}", config,
                                             monkeypatch, advantage_sign=advantage_sign)
    rises = {seed: reward_rise(curve) for seed, curve in curves.items()}
    mean_rise = sum(rises.values()) / len(rises)
    report = {seed: [round(r, 3) for r in curve] for seed, curve in curves.items()}
    if advantage_sign > 0:
        assert mean_rise > MARGIN, (rises, report)
    else:
        assert mean_rise < NO_LEARNING_BOUND, (rises, report)
