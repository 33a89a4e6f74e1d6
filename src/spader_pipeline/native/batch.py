"""From finished trajectories to the tensors RL needs: token layout, rewards, advantages.

Everything algorithmic comes from :mod:`spader_pipeline.algorithms` (rewards, SPA, CalibAdv, TSPO)
and from verl's ``core_algos`` (the GRPO estimator); this module only lines the trajectories up.

Step ``t`` of a trajectory is its ``t``-th assistant turn, which is also the ``t``-th run of 1s in
its ``response_mask``; the documents that turn's tool call retrieved are that step's evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spader_pipeline.algorithms import (
    SpaderRewardConfig,
    calibadv_advantage,
    calibadv_step_scores,
    discover_entities,
    first_occurrence_steps,
    score_answers,
    segment_steps,
    spa_advantage,
    spader_rewards,
    tspo_advantage,
)


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
    f1: torch.Tensor
    """``[B]`` final-answer F1 (0 without a valid answer)"""
    precision: torch.Tensor
    recall: torch.Tensor
    format_ok: torch.Tensor
    """bool ``[B]``: the trajectory ended with a well-formed answer"""
    found: torch.Tensor
    """bool ``[B, S, E]``: gold entity ``e`` in the documents retrieved at step ``s``"""
    num_gt: torch.Tensor
    """long ``[B]`` distinct gold entities"""
    query_counts: torch.Tensor
    """float ``[B, S]`` queries executed at each step"""
    step_doc_ids: list[list[list[str]]]
    """per trajectory, per step, ids of the retrieved documents"""
    step_thinks: list[list[str]]
    """per trajectory, per step, the turn text (CalibAdv's near-duplicate check)"""
    num_turns: torch.Tensor
    num_searches: torch.Tensor


def build_batch(trajectories: Sequence[Any], samples: Sequence[Mapping[str, Any]], pad_id: int) -> RolloutBatch:
    """Lay out token-level trajectories (``agent.rollout.Trajectory``) and score their answers.

    ``samples[i]`` is the sample trajectory ``i`` was rolled out for (``uid``, ``ground_truth``).
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

    gts = [_ground_truth(s["ground_truth"]) for s in samples]
    scores = [score_answers(list(t.predicted or ()), gt) for t, gt in zip(trajectories, gts, strict=True)]
    format_ok = torch.tensor([t.predicted is not None for t in trajectories])
    step_texts = [["\n".join(step.retrieved_texts) for step in t.steps] for t in trajectories]
    found, num_gt = discover_entities(gts, step_texts)
    n_steps = found.shape[1]
    query_counts = torch.zeros((bsz, n_steps), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        for s, step in enumerate(t.steps):
            if step.kind == "search" and step.doc_ids:
                query_counts[i, s] = len(step.queries)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        prompt_lengths=torch.tensor(prompt_len, dtype=torch.long),
        response_ids=response_ids,
        response_mask=response_mask,
        uids=np.array([str(s["uid"]) for s in samples], dtype=object),
        ground_truths=gts,
        f1=torch.tensor([sc.f1 for sc in scores], dtype=torch.float32),
        precision=torch.tensor([sc.precision for sc in scores], dtype=torch.float32),
        recall=torch.tensor([sc.recall for sc in scores], dtype=torch.float32),
        format_ok=format_ok,
        found=found,
        num_gt=num_gt,
        query_counts=query_counts,
        step_doc_ids=[[[d for q in step.doc_ids for d in q] for step in t.steps] for t in trajectories],
        step_thinks=[[step.text for step in t.steps] for t in trajectories],
        num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.float32),
        num_searches=torch.tensor([t.num_searches for t in trajectories], dtype=torch.float32),
    )


def _ground_truth(value: Any) -> list[list[str]]:
    """``[[alias, ...], ...]`` from lists, numpy arrays (parquet) or a flat list of names."""
    out: list[list[str]] = []
    for entity in list(value):
        if isinstance(entity, str):
            out.append([entity])
        else:
            out.append([str(a) for a in list(entity)])
    return out


@dataclass
class Advantages:
    """Rewards and advantages of a batch."""

    token_rewards: torch.Tensor
    """float ``[B, R]`` (summed per row = the trajectory's return)"""
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
    reward: Mapping[str, Any],
    advantage: Mapping[str, Any],
) -> Advantages:
    """Rewards and advantages of ``batch`` for ``method`` at ``global_step``.

    - ``grpo``: outcome reward (``w_F·F1`` or ``−format_penalty``) on the last model token, verl's
      own ``compute_grpo_outcome_advantage``;
    - ``spader``: SPADER's exploration + final rewards on step anchors (tool cost driven by
      ``global_step``), step-wise peer advantage (``gamma``);
    - ``calibadv``: outcome reward, silver-document step scores, CalibAdv advantage;
    - ``tspo``: outcome reward, first-occurrence step of a gold entity, TSPO (proposal) advantage.
    """
    mask = batch.response_mask
    explore = method == "spader" and reward.get("enable_exploration", True)
    reward_cfg = SpaderRewardConfig(**{**dict(reward), "enable_exploration": explore})
    layout = segment_steps(mask)
    rewards = spader_rewards(
        mask,
        batch.uids,
        f1=batch.f1,
        format_ok=batch.format_ok,
        global_step=global_step,
        config=reward_cfg,
        found=batch.found if explore else None,
        num_gt=batch.num_gt if explore else None,
        query_counts=batch.query_counts if explore else None,
        layout=layout,
    )
    token_rewards = rewards.token_rewards
    outcome = rewards.final
    adv_kwargs = dict(advantage)
    if method == "grpo":
        from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

        adv, _ = compute_grpo_outcome_advantage(
            token_level_rewards=token_rewards,
            response_mask=mask,
            index=batch.uids,
            norm_adv_by_std_in_grpo=bool(adv_kwargs.get("norm_adv_by_std_in_grpo", True)),
        )
    elif method == "spader":
        adv, _ = spa_advantage(token_rewards, mask, batch.uids, gamma=float(adv_kwargs.get("gamma", 1.0)), layout=layout)
    elif method == "calibadv":
        scores = calibadv_step_scores(
            batch.step_doc_ids,
            outcome.tolist(),
            batch.format_ok.tolist(),
            batch.uids,
            thinks=batch.step_thinks,
            silver_threshold=float(adv_kwargs.get("silver_threshold", 0.7)),
            num_steps=layout.max_steps,
        )
        adv, _ = calibadv_advantage(
            outcome, mask, batch.uids, scores,
            target_ratio=float(adv_kwargs.get("target_ratio", 1.0)), layout=layout,
        )
    elif method == "tspo":
        adv, _ = tspo_advantage(
            outcome, first_occurrence_steps(batch.found), mask, batch.uids,
            latent_reward=float(adv_kwargs.get("latent_reward", 0.5)), layout=layout,
        )
    else:
        raise ValueError(f"unknown method {method!r}")
    if rewards.exploration is not None:
        discovery = rewards.exploration.discovery.sum(dim=1)
        c_eff = rewards.exploration.cost_coefficient
    else:
        discovery = torch.zeros(mask.shape[0])
        c_eff = 0.0
    return Advantages(token_rewards, adv.float() * mask, discovery, c_eff)
