"""Decision steps of multi-turn trajectories, found from ``response_mask`` without Python token loops.

A response is ``[model turn][observation][model turn]…[model turn][padding]``; ``response_mask`` is 1
on model tokens and 0 on observation and padding tokens. Every maximal run of 1s is one *decision
step*; its last token is the step's *anchor* (where SPADER places step rewards, spec §3.3 and §4.1),
and the last run is the answer step. The reference walks every token with ``tensor.item()`` (spec
§9.9); here the segmentation is a handful of batched tensor ops (reference defect 7).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepLayout", "gather_steps", "scatter_to_anchors", "segment_steps", "spread_over_steps"]


@dataclass(frozen=True)
class StepLayout:
    """Step segmentation of a batch of responses.

    Attributes:
        step_index: long ``[B, T]``, the step each model token belongs to, ``-1`` elsewhere.
        starts: long ``[B, S]``, first token of each step (``0`` on padded steps).
        anchors: long ``[B, S]``, last token of each step (``0`` on padded steps).
        step_mask: bool ``[B, S]``, ``True`` for real steps (always a prefix of each row).
        num_steps: long ``[B]``, number of steps ``K_i``.
    ``S = max_i K_i`` (or ``max_steps`` if given and larger).
    """

    step_index: torch.Tensor
    starts: torch.Tensor
    anchors: torch.Tensor
    step_mask: torch.Tensor
    num_steps: torch.Tensor

    @property
    def max_steps(self) -> int:
        return int(self.anchors.shape[1])

    @property
    def last_anchor(self) -> torch.Tensor:
        """long ``[B]``: anchor of the final (answer) step; ``-1`` for responses without steps."""
        if self.max_steps == 0:
            return torch.full_like(self.num_steps, -1)
        last = (self.num_steps - 1).clamp(min=0)
        out = self.anchors.gather(1, last.unsqueeze(1)).squeeze(1)
        return torch.where(self.num_steps > 0, out, torch.full_like(out, -1))


def segment_steps(response_mask: torch.Tensor, max_steps: int | None = None) -> StepLayout:
    """Split every response into decision steps (maximal runs of ``response_mask == 1``).

    Args:
        response_mask: ``[B, T]`` (any dtype; nonzero = model token). Must already be 0 on padding.
        max_steps: minimum width ``S`` of the step axis (e.g. to align with another tensor).

    Returns:
        :class:`StepLayout`. Cost: O(B·T) tensor ops plus one ``nonzero`` per batch.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
    m = response_mask != 0
    bsz, _ = m.shape
    device = m.device
    prev = torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)
    nxt = torch.nn.functional.pad(m[:, 1:], (0, 1), value=False)
    is_start = m & ~prev
    is_end = m & ~nxt
    run_id = is_start.long().cumsum(dim=1) - 1  # step number of each token within its row
    step_index = torch.where(m, run_id, torch.full_like(run_id, -1))
    num_steps = is_start.sum(dim=1)
    width = int(num_steps.max().item()) if bsz else 0
    if max_steps is not None:
        width = max(width, int(max_steps))
    starts = torch.zeros((bsz, width), dtype=torch.long, device=device)
    anchors = torch.zeros((bsz, width), dtype=torch.long, device=device)
    if width:
        b, t = is_start.nonzero(as_tuple=True)
        starts[b, run_id[b, t]] = t
        b, t = is_end.nonzero(as_tuple=True)
        anchors[b, run_id[b, t]] = t
    step_mask = torch.arange(width, device=device).unsqueeze(0) < num_steps.unsqueeze(1)
    return StepLayout(step_index, starts, anchors, step_mask, num_steps)


def gather_steps(token_values: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """``[B, T]`` → ``[B, S]``: the value at each step's anchor (0 on padded steps)."""
    if layout.max_steps == 0:
        return token_values.new_zeros((token_values.shape[0], 0))
    out = token_values.gather(1, layout.anchors)
    return out * layout.step_mask.to(out.dtype)


def scatter_to_anchors(step_values: torch.Tensor, layout: StepLayout, length: int) -> torch.Tensor:
    """``[B, S]`` → ``[B, T]``: each real step's value placed on its anchor token, zeros elsewhere."""
    out = step_values.new_zeros((step_values.shape[0], length))
    if layout.max_steps == 0:
        return out
    s = min(step_values.shape[1], layout.max_steps)
    vals = step_values[:, :s] * layout.step_mask[:, :s].to(step_values.dtype)
    out.scatter_add_(1, layout.anchors[:, :s], vals)
    return out


def spread_over_steps(step_values: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """``[B, S]`` → ``[B, T]``: each model token gets its step's value; other tokens get 0."""
    idx = layout.step_index.clamp(min=0)
    if layout.max_steps == 0:
        return step_values.new_zeros(idx.shape)
    if step_values.shape[1] < layout.max_steps:
        raise ValueError(f"step_values has {step_values.shape[1]} steps, the layout {layout.max_steps}")
    out = step_values.gather(1, idx.clamp(max=step_values.shape[1] - 1))
    return torch.where(layout.step_index >= 0, out, torch.zeros_like(out))
