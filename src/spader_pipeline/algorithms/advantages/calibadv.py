"""CalibAdv — calibrated GRPO advantages for deep search (arXiv 2604.18235; code wujwyi/CalibAdv).

As in the paper and its code; defaults from the released training script (docs/algorithms.md):
silver threshold 0.7, think-similarity 0.5, more than one repeated document voids a turn, ε = 1e-6,
``target_ratio`` λ = 1.0, soft penalty applied before rebalancing.

1. **Step correctness from silver documents** (:func:`calibadv_step_scores`). Per group, the rollouts
   with valid format and outcome ≥ 0.7 qualify; the documents retrieved by the best-scoring qualifying
   rollouts form the silver set. Search turn ``t`` of a format-valid rollout scores
   ``q_t = g_t / n_t`` where ``g_t`` counts its newly retrieved silver documents, or the marker
   ``1e-6`` ("evaluated, not correct") when ``g_t = 0``, when its ``<think>`` nearly repeats an earlier
   one, or when it repeats more than one earlier document. ``0`` means "not evaluated".
2. **GRPO** on outcome rewards (unbiased std, singleton → mean 0 / std 1).
3. **Soft penalty**: for ``A_i < 0``, search turn ``t`` gets ``A_i·(1 − q_t)`` when ``q_t > 1e-6``.
4. **Answer rebalancing per group**: over the answer-step tokens of the group, with ``P`` the sum of
   positive and ``N`` the sum of negative token advantages, positive answer tokens are scaled by
   ``|N| / (λ·P)``; if ``P = 0`` or ``N = 0`` every answer-step advantage of the group becomes 0.

Step ``t`` here is the ``t``-th run of model tokens; the last run is the answer component.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..steps import StepLayout, segment_steps, spread_over_steps
from ._groups import group_index
from .grpo import grpo_scalar_advantage

__all__ = [
    "NOT_CORRECT",
    "calibadv_advantage",
    "calibadv_step_scores",
    "word_similarity",
]

#: Marker score of a search turn that was evaluated and found not correct.
NOT_CORRECT = 1e-6


def word_similarity(a: str, b: str) -> float:
    """``1 − lev(words_a, words_b) / max(|a|, |b|)`` on whitespace tokens (1.0 for two empty texts)."""
    wa, wb = a.split(), b.split()
    if not wa and not wb:
        return 1.0
    prev = list(range(len(wb) + 1))
    for i, x in enumerate(wa, start=1):
        cur = [i] + [0] * len(wb)
        for j, y in enumerate(wb, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return 1.0 - prev[-1] / max(len(wa), len(wb))


def calibadv_step_scores(
    documents: Sequence[Sequence[Sequence[str]]],
    outcomes: Sequence[float],
    format_ok: Sequence[bool],
    index: Sequence[object] | np.ndarray,
    *,
    thinks: Sequence[Sequence[str]] | None = None,
    silver_threshold: float = 0.7,
    think_similarity: float = 0.5,
    max_repeated_docs: int = 1,
    num_steps: int | None = None,
) -> torch.Tensor:
    """Silver-document step scores ``q`` (float ``[B, S]``; 0 = not evaluated).

    Args:
        documents: per rollout, per search turn, the identities (e.g. ids or exact texts) of the documents
            that turn retrieved.
        outcomes: per rollout outcome reward ``r_i``; ``format_ok``: strict-format validity.
        index: group labels.
        thinks: per rollout, per search turn, the turn's reasoning text (near-duplicates are voided);
            ``None`` skips that check.
        num_steps: width ``S`` of the result (default: the most search turns of any rollout).
    """
    bsz = len(documents)
    width = num_steps if num_steps is not None else max((len(d) for d in documents), default=0)
    scores = torch.zeros((bsz, width), dtype=torch.float32)
    groups = group_index(index)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.ids.tolist()):
        members.setdefault(g, []).append(i)
    for rows in members.values():
        qualifying = [i for i in rows if format_ok[i] and outcomes[i] >= silver_threshold]
        if not qualifying:
            continue  # no silver set: this group's steps stay unevaluated
        best = max(outcomes[i] for i in qualifying)
        silver = {d for i in qualifying if outcomes[i] == best for turn in documents[i] for d in turn}
        for i in rows:
            if not format_ok[i]:
                continue
            seen: set[str] = set()
            earlier_turns: list[set[str]] = []
            earlier_thinks: list[str] = []
            for t, turn in enumerate(documents[i][:width]):
                docs = list(turn)
                gain = sum(1 for d in set(docs) if d in silver and d not in seen)
                think = thinks[i][t] if thinks is not None and t < len(thinks[i]) else None
                if think is not None and any(
                    word_similarity(think, e) > think_similarity for e in earlier_thinks
                ):
                    gain = 0
                if any(len(set(docs) & e) > max_repeated_docs for e in earlier_turns):
                    gain = 0
                scores[i, t] = gain / len(docs) if gain > 0 and docs else NOT_CORRECT
                seen.update(docs)
                earlier_turns.append(set(docs))
                if think is not None:
                    earlier_thinks.append(think)
    return scores


@torch.no_grad()
def calibadv_advantage(
    outcome_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray | torch.Tensor,
    step_scores: torch.Tensor | None = None,
    *,
    target_ratio: float = 1.0,
    epsilon: float = 1e-6,
    soft_penalty: bool = True,
    rebalance_answer: bool = True,
    layout: StepLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level CalibAdv advantages.

    Args:
        outcome_rewards: ``[B]`` outcome reward per rollout.
        response_mask: ``[B, T]`` model-token mask (0 on observations and padding).
        index: ``[B]`` group labels.
        step_scores: ``[B, S']`` search-turn scores from :func:`calibadv_step_scores` (turn ``t`` = step
            ``t``); the answer step is never penalty-softened. ``None`` = plain GRPO + rebalancing.
        target_ratio: λ of the answer rebalancing.
    Returns:
        ``(advantages, returns)`` ``[B, T]``; ``returns`` is the GRPO advantage (informational).
    """
    layout = layout if layout is not None else segment_steps(response_mask)
    scores = outcome_rewards.float()
    grpo = grpo_scalar_advantage(scores, index, epsilon=epsilon)
    mask = (response_mask != 0).float()
    width = layout.max_steps
    factor = torch.ones((scores.shape[0], width), dtype=torch.float32, device=scores.device)
    is_answer = torch.zeros_like(factor, dtype=torch.bool)
    if width:
        is_answer = torch.arange(width, device=scores.device).unsqueeze(0) == (
            layout.num_steps - 1
        ).unsqueeze(1)
    if soft_penalty and step_scores is not None and width:
        q = torch.zeros_like(factor)
        k = min(width, step_scores.shape[1])
        q[:, :k] = step_scores[:, :k].float()
        soften = (grpo < 0).unsqueeze(1) & (q > NOT_CORRECT) & ~is_answer
        factor = torch.where(soften, 1.0 - q, factor)
    step_adv = grpo.unsqueeze(1) * factor
    adv = spread_over_steps(step_adv, layout) * mask if width else torch.zeros_like(mask)
    if rebalance_answer and width:
        answer_tok = spread_over_steps(is_answer.float(), layout) > 0
        groups = group_index(index, device=scores.device)
        pos = torch.where(answer_tok & (adv > 0), adv, torch.zeros_like(adv)).sum(dim=1)
        neg = torch.where(answer_tok & (adv < 0), adv, torch.zeros_like(adv)).sum(dim=1)
        p_g, n_g = groups.sum(pos)[groups.ids], groups.sum(neg)[groups.ids]
        degenerate = (p_g == 0) | (n_g == 0)
        scale = torch.where(
            degenerate, torch.zeros_like(p_g), n_g.abs() / (target_ratio * p_g).clamp(min=1e-30)
        )
        pos_scale = scale.unsqueeze(1)
        rebalanced = torch.where(
            adv > 0, adv * pos_scale, torch.where(degenerate.unsqueeze(1), torch.zeros_like(adv), adv)
        )
        adv = torch.where(answer_tok, rebalanced, adv)
    returns = grpo.unsqueeze(1) * mask
    return adv, returns
