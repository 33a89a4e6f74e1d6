"""From finished trajectories to the tensors RL needs: token layout, rewards, advantages.

Everything algorithmic comes from the method registry :mod:`spader_pipeline.algorithms.methods`,
the same definitions the verl plugin uses; this module only lines the trajectories up.

Step ``t`` of a trajectory is its ``t``-th assistant turn, which is also the ``t``-th run of 1s in
its ``response_mask``; the documents that turn's tool call retrieved are that step's evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spader_pipeline.agent.protocol import think_text
from spader_pipeline.algorithms import SpaderRewardConfig, discover_entities, score_answers
from spader_pipeline.algorithms.methods import RewardInputs, method_advantages, method_rewards
from spader_pipeline.algorithms.steps import segment_steps
from spader_pipeline.data.schema import ground_truth_lists

logger = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """A step's trajectories as right-padded tensors plus the per-trajectory facts rewards need.

    Shapes: ``B`` trajectories, ``R`` longest response, ``L`` longest prompt + response.
    """

    input_ids: torch.Tensor
    """long ``[B, L]``: prompt then response, right-padded"""
    attention_mask: torch.Tensor
    """long ``[B, L]``"""
    prompt_lengths: torch.Tensor
    """long ``[B]``: where each response starts in ``input_ids``"""
    response_ids: torch.Tensor
    """long ``[B, R]``"""
    response_mask: torch.Tensor
    """float ``[B, R]``: 1 on model tokens, 0 on observation and padding tokens"""
    uids: np.ndarray
    """``[B]`` group label (one per prompt)"""
    ground_truths: list[list[list[str]]]
    """per trajectory, the gold entities (alias lists)"""
    rewards: RewardInputs
    """what the method registry's rewards read: answer F1 / exact match, format, gold entities
    found per step, queries per step, retrieved document ids and ``<think>`` texts per step"""
    precision: torch.Tensor
    recall: torch.Tensor
    num_turns: torch.Tensor
    num_searches: torch.Tensor
    boundary: torch.Tensor | None = None
    """float ``[B, L, H]`` aligned with ``input_ids``: the rollout's output of the last frozen block
    (the input of block ``boundary_block``) at every position a loss term reads from, zeros
    elsewhere, on the rollout's device; ``None``: the update runs the frozen blocks itself
    (docs/training.md)"""
    boundary_block: int | None = None
    """the first decoder block the update runs from ``boundary``"""


def build_batch(trajectories: Sequence[Any], samples: Sequence[Mapping[str, Any]], pad_id: int, *,
                captured: Sequence[Any] | None = None, boundary_block: int | None = None) -> RolloutBatch:
    """Lay out token-level trajectories (``agent.rollout.Trajectory``) and score their answers.

    ``samples[i]`` is the sample trajectory ``i`` was rolled out for (``uid``, ``ground_truth``).
    ``captured[i]``: the states its rollout computed at the input of block ``boundary_block``
    (:class:`~spader_pipeline.agent.state_capture.CapturedStates` or ``None``); they become
    ``boundary`` when every trajectory has a usable capture (:func:`boundary_states`).
    """
    bsz = len(trajectories)
    prompt_len = [len(t.prompt_ids) for t in trajectories]
    resp_len = [len(t.response_ids) for t in trajectories]
    width_r = max(max(resp_len, default=0), 1)
    width = max(p + r for p, r in zip(prompt_len, resp_len, strict=True))
    input_ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attention = torch.zeros((bsz, width), dtype=torch.long)
    response_ids = torch.full((bsz, width_r), pad_id, dtype=torch.long)
    response_mask = torch.zeros((bsz, width_r), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        seq = list(t.prompt_ids) + list(t.response_ids)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        if t.response_ids:
            response_ids[i, : resp_len[i]] = torch.tensor(t.response_ids, dtype=torch.long)
            response_mask[i, : resp_len[i]] = torch.tensor(t.response_mask, dtype=torch.float32)

    gts = [ground_truth_lists(s["ground_truth"]) for s in samples]
    scores = [score_answers(list(t.predicted or ()), gt) for t, gt in zip(trajectories, gts, strict=True)]
    # Each step's documents as a list (not one joined string): a document many trajectories
    # retrieved is normalised once per batch, and no alias can match across two documents.
    step_documents = [[list(step.retrieved_texts) for step in t.steps] for t in trajectories]
    found, num_gt = discover_entities(gts, step_documents)
    boundary = None
    if captured is not None and boundary_block is not None:
        boundary = boundary_states(trajectories, captured, width)
    return RolloutBatch(
        boundary=boundary,
        boundary_block=boundary_block if boundary is not None else None,
        input_ids=input_ids,
        attention_mask=attention,
        prompt_lengths=torch.tensor(prompt_len, dtype=torch.long),
        response_ids=response_ids,
        response_mask=response_mask,
        uids=np.array([str(s["uid"]) for s in samples], dtype=object),
        ground_truths=gts,
        rewards=RewardInputs.from_steps(
            f1=[sc.f1 for sc in scores],
            exact_match=[sc.exact_match for sc in scores],
            format_ok=[t.predicted is not None for t in trajectories],
            num_gt=num_gt,
            found=found,
            query_counts=[[len(step.queries) if step.kind == "search" and step.doc_ids else 0 for step in t.steps]
                          for t in trajectories],
            step_documents=[[[d for q in step.doc_ids for d in q] for step in t.steps] for t in trajectories],
            step_thinks=[[think_text(step.text) for step in t.steps] for t in trajectories],
        ),
        precision=torch.tensor([sc.precision for sc in scores], dtype=torch.float32),
        recall=torch.tensor([sc.recall for sc in scores], dtype=torch.float32),
        num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.float32),
        num_searches=torch.tensor([t.num_searches for t in trajectories], dtype=torch.float32),
    )


def usable_capture(trajectory: Any, capture: Any) -> bool:
    """Whether ``capture`` (``CapturedStates``) holds ``trajectory``'s states wherever its loss reads:
    its ids are the trajectory's first tokens and it covers every position before the last model
    token (the hidden state at ``p - 1`` predicts token ``p``; a position only affects later ones)."""
    if capture is None:
        return False
    tokens = list(trajectory.prompt_ids) + list(trajectory.response_ids)
    n = int(capture.token_ids.shape[0])
    model_positions = [len(trajectory.prompt_ids) + i for i, m in enumerate(trajectory.response_mask) if m]
    needed = model_positions[-1] if model_positions else 0
    return needed <= n <= len(tokens) and capture.token_ids.tolist() == tokens[:n] and capture.states.shape[0] == n


def boundary_states(trajectories: Sequence[Any], captured: Sequence[Any], width: int) -> torch.Tensor | None:
    """The captured states as float ``[B, width, H]`` on the captures' device (the rollout's, where the
    update runs), right-padded as ``input_ids`` (uncovered and padding positions zero), or ``None``
    (logged) unless every trajectory's capture is usable (:func:`usable_capture`): the update then
    runs the frozen blocks itself."""
    captured = list(captured)
    if not trajectories:
        return None
    if len(captured) != len(trajectories):
        bad = len(trajectories)
    else:
        bad = sum(not usable_capture(t, c) for t, c in zip(trajectories, captured, strict=True))
    if bad:
        logger.info("frozen blocks recomputed in the update: %d of %d trajectories have no usable rollout states",
                    bad, len(trajectories))
        return None
    first = captured[0].states
    out = torch.zeros((len(trajectories), width, first.shape[1]), dtype=torch.float32, device=first.device)
    for row, capture in enumerate(captured):
        out[row, : capture.states.shape[0]] = capture.states
    return out


@dataclass
class Advantages:
    """Rewards and advantages of a batch."""

    token_rewards: torch.Tensor
    """float ``[B, R]`` in the method's reward layout (what the estimator reads)"""
    returns: torch.Tensor
    """float ``[B]`` each trajectory's reward (outcome + exploration − tool cost)"""
    advantages: torch.Tensor
    """float ``[B, R]`` (0 off model tokens)"""
    discovery: torch.Tensor
    """float ``[B]`` novelty-weighted discovery reward (SPADER's exploration term; 0 for other methods)"""
    cost_coefficient: float
    """the tool cost ``c_eff`` applied at this global step"""


def compute_advantages(
    batch: RolloutBatch,
    method: str,
    *,
    global_step: int,
    reward: SpaderRewardConfig,
    options: Any,
) -> Advantages:
    """Rewards and advantages of ``batch`` for ``method`` at ``global_step`` (the tool-cost schedule).

    The reward layout and the estimator are the method's registry entry
    (:mod:`spader_pipeline.algorithms.methods`), exactly what the verl plugin runs.
    """
    mask = batch.response_mask
    layout = segment_steps(mask)
    rewards = method_rewards(
        method, mask, batch.uids, batch.rewards, global_step=global_step, reward=reward,
        options=options, layout=layout,
    )
    adv, _ = method_advantages(method, rewards.token_rewards, mask, batch.uids, options, layout)
    return Advantages(rewards.token_rewards, rewards.returns, adv, rewards.discovery, rewards.cost_coefficient)


#: the :class:`Rollouts` fields read from the rollout engine's counters of the same names
#: (:class:`~spader_pipeline.agent.decode_engine.DecodeEngine`; 0 where an engine keeps none)
ENGINE_COUNTERS = ("model_seconds", "decode_steps", "prefill_seconds", "decoding_seconds", "prefill_tokens",
                   "prefill_positions")


@dataclass
class Rollouts:
    """One step's trajectories, as generated and as tensors."""

    trajectories: list[Any]
    batch: RolloutBatch
    seconds: float
    generated_tokens: int
    capture_seconds: float = 0.0
    """of ``seconds``, copying the boundary states out of the decoding caches"""
    model_seconds: float = 0.0
    """of ``seconds``, in the model's turns (prefill, decoding, capture); the rest is the search,
    tokenising and the agent's bookkeeping"""
    decode_steps: int = 0
    """decoding steps over the rollout's turns (each turn as long as its longest row)"""
    prefill_seconds: float = 0.0
    """of ``model_seconds``, the turns' prefill forwards (device-synced)"""
    decoding_seconds: float = 0.0
    """of ``model_seconds``, the decoding steps after them (device-synced)"""
    prefill_tokens: int = 0
    """real tokens the turns' prefills fed"""
    prefill_positions: int = 0
    """positions the prefills' forwards computed (rows x padded width): the rest of ``prefill_tokens`` is padding"""


def questions_for_step(samples: Sequence[Mapping[str, Any]], step: int, k: int, seed: int) -> list[Mapping[str, Any]]:
    """The ``k`` questions of global step ``step`` (1-based): a seeded permutation per epoch.

    A pure function of the step, so a resumed run sees exactly the questions it would have seen.
    """
    n = len(samples)
    out = []
    for j in range((step - 1) * k, step * k):
        epoch, pos = divmod(j, n)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(samples[int(order[pos])])
    return out
