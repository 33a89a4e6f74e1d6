"""The rollout metrics of one training step, the same on both trainers (names: docs/metrics.md).

:func:`rollout_step_metrics` takes what either trainer has of a step's batch, as tensors: the native
trainer from its ``RolloutBatch`` (:func:`spader_pipeline.native.metrics.step_metrics`), the verl plugin
from its reward manager's per-sample payloads (:func:`spader_pipeline.verl_plugin.reward_manager.
mechanism_metrics_from_payloads`). So ``method_reward/*``, ``answer/*``, ``retrieval/*``, ``rollout/*``
and ``adv/*`` mean the same in a native run's MLflow run and a verl run's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["rollout_step_metrics"]


def rollout_step_metrics(
    *,
    returns: torch.Tensor,
    discovery: torch.Tensor,
    cost_coefficient: float,
    f1: torch.Tensor,
    recall: torch.Tensor,
    precision: torch.Tensor,
    format_ok: torch.Tensor,
    found: torch.Tensor,
    num_gt: torch.Tensor,
    num_turns: torch.Tensor,
    num_searches: torch.Tensor,
    response_tokens: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    uids: Sequence[object],
) -> dict[str, float]:
    """Rewards, answers, retrieval, trajectory shape and advantages of a step's ``B`` trajectories.

    Args:
        returns: ``[B]`` each trajectory's method reward (outcome + exploration − tool cost).
        discovery: ``[B]`` the method's exploration term (0 where it has none).
        cost_coefficient: the tool cost ``c_eff`` of the step.
        f1, recall, precision: ``[B]`` the answer's scores; ``format_ok``: bool ``[B]``.
        found: bool ``[B, S, E]`` gold entities in each step's documents; ``num_gt``: ``[B]``.
        num_turns, num_searches: ``[B]`` assistant turns, searches executed.
        response_tokens: ``[B]`` response length (observations included).
        response_mask: ``[B, R]`` 1 on model tokens; ``advantages``: ``[B, R]``.
        uids: ``B`` group labels (a group's returns all equal: no signal, ``adv/zero_groups``).
    """
    mask = response_mask.float()
    traj_found = found.any(dim=1).sum(dim=-1).float() if found.numel() else torch.zeros(len(mask))
    gt = num_gt.float().clamp(min=1)
    tok_adv = advantages[mask.bool()]
    groups: dict[object, list[float]] = {}
    for uid, r in zip(list(uids), returns.tolist(), strict=True):
        groups.setdefault(uid, []).append(r)
    zero_groups = sum(1 for v in groups.values() if max(v) - min(v) < 1e-8) / max(len(groups), 1)
    return {
        "method_reward/mean": float(returns.mean()),
        "method_reward/std": float(returns.std()) if len(returns) > 1 else 0.0,
        "method_reward/final_mean": float(torch.where(format_ok.bool(), f1.float(), torch.zeros_like(f1.float())).mean()),
        "method_reward/discovery_mean": float(discovery.float().mean()),
        "method_reward/tool_cost_coef": float(cost_coefficient),
        "answer/f1": float(f1.float().mean()),
        "answer/recall": float(recall.float().mean()),
        "answer/precision": float(precision.float().mean()),
        "answer/format_ok": float(format_ok.float().mean()),
        "retrieval/entities_found": float(traj_found.mean()),
        "retrieval/recall": float((traj_found / gt).mean()),
        "rollout/turns": float(num_turns.float().mean()),
        "rollout/tool_calls": float(num_searches.float().mean()),
        "rollout/response_tokens": float(response_tokens.float().mean()),
        "rollout/model_tokens": float(mask.sum(dim=1).mean()),
        "adv/mean": float(tok_adv.mean()) if tok_adv.numel() else 0.0,
        "adv/std": float(tok_adv.std()) if tok_adv.numel() > 1 else 0.0,
        "adv/abs_mean": float(tok_adv.abs().mean()) if tok_adv.numel() else 0.0,
        "adv/zero_groups": zero_groups,
    }
