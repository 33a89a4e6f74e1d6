"""Decision steps of multi-turn trajectories, found from ``response_mask`` without Python token loops.

A response is ``[model turn][observation][model turn]…[model turn][padding]``; ``response_mask`` is 1
on model tokens and 0 on observation and padding tokens. Every maximal run of 1s is one *decision
step*; its last token is the step's *anchor* (where SPADER places step rewards; docs/algorithms.md),
and the last run is the answer step. The segmentation is a handful of batched tensor ops, with no
Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = [
    "StepLayout",
    "gather_steps",
    "place_on_anchors",
    "scatter_to_anchors",
    "segment_steps",
    "spread_over_steps",
]


@dataclass(frozen=True)
class StepLayout:
    """Step segmentation of a batch of responses.

    Attributes:
        token_mask: bool ``[B, T]``, model tokens.
        starts: long ``[B, S]``, first token of each step (``0`` on padded steps).
        anchors: long ``[B, S]``, last token of each step (``0`` on padded steps).
        step_mask: bool ``[B, S]``, ``True`` for real steps (always a prefix of each row).
        num_steps: long ``[B]``, number of steps ``K_i``.
        run_row, run_step, run_length: long ``[R]``, row, step number and length of each of the ``R``
            steps of the batch, in row-major token order.
    ``S = max_i K_i`` (or ``max_steps`` if given and larger).
    """

    token_mask: torch.Tensor
    starts: torch.Tensor
    anchors: torch.Tensor
    step_mask: torch.Tensor
    num_steps: torch.Tensor
    run_row: torch.Tensor
    run_step: torch.Tensor
    run_length: torch.Tensor

    @property
    def max_steps(self) -> int:
        return int(self.anchors.shape[1])

    @cached_property
    def token_runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat_positions, run_ids)``, long ``[N]`` each, for the ``N`` model tokens of the batch.

        Built from the runs alone (``O(N)``, no pass over ``[B, T]``); cached.
        """
        length = self.token_mask.shape[1]
        run_ids = torch.repeat_interleave(
            torch.arange(self.run_row.numel(), device=self.run_row.device), self.run_length
        )
        first_token = torch.cumsum(self.run_length, 0) - self.run_length  # offset of each run in the N tokens
        run_start = self.run_row * length + self.starts[self.run_row, self.run_step]
        within = torch.arange(run_ids.numel(), device=run_ids.device) - first_token[run_ids]
        return run_start[run_ids] + within, run_ids

    @property
    def step_index(self) -> torch.Tensor:
        """long ``[B, T]``: the step each model token belongs to, ``-1`` elsewhere."""
        positions, runs = self.token_runs
        out = torch.full(self.token_mask.shape, -1, dtype=torch.long, device=self.token_mask.device)
        out.view(-1)[positions] = self.run_step[runs]
        return out

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
        :class:`StepLayout`. Cost: a few elementwise passes over ``[B, T]`` and two ``nonzero`` calls.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
    m = response_mask != 0
    bsz, length = m.shape
    device = m.device
    # Transitions of the zero-padded mask alternate start, end, start, end... within every row, and
    # every row has an even number of them, so even/odd positions of the flat list are starts/ends.
    padded = torch.zeros((bsz, length + 2), dtype=torch.bool, device=device)
    padded[:, 1:-1] = m
    flips = (padded[:, 1:] != padded[:, :-1]).view(-1).nonzero().squeeze(1)
    rows = torch.div(flips, length + 1, rounding_mode="floor")
    cols = flips - rows * (length + 1)
    run_row, start_t, end_excl = rows[0::2], cols[0::2], cols[1::2]
    num_steps = torch.bincount(run_row, minlength=bsz)
    first_run = torch.cumsum(num_steps, 0) - num_steps
    run_step = torch.arange(run_row.numel(), device=device) - first_run[run_row]
    width = int(num_steps.max().item()) if bsz else 0
    if max_steps is not None:
        width = max(width, int(max_steps))
    starts = torch.zeros((bsz, width), dtype=torch.long, device=device)
    anchors = torch.zeros((bsz, width), dtype=torch.long, device=device)
    starts[run_row, run_step] = start_t
    anchors[run_row, run_step] = end_excl - 1
    step_mask = torch.arange(width, device=device).unsqueeze(0) < num_steps.unsqueeze(1)
    return StepLayout(m, starts, anchors, step_mask, num_steps, run_row, run_step, end_excl - start_t)


def gather_steps(token_values: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """``[B, T]`` → ``[B, S]``: the value at each step's anchor (0 on padded steps)."""
    if layout.max_steps == 0:
        return token_values.new_zeros((token_values.shape[0], 0))
    out = token_values.gather(1, layout.anchors)
    return out * layout.step_mask.to(out.dtype)


def scatter_to_anchors(step_values: torch.Tensor, layout: StepLayout, length: int) -> torch.Tensor:
    """``[B, S]`` → ``[B, T]``: each real step's value placed on its anchor token, zeros elsewhere."""
    out = step_values.new_zeros((step_values.shape[0], length))
    keep = layout.run_step < step_values.shape[1]
    rows, steps = layout.run_row[keep], layout.run_step[keep]
    out[rows, layout.anchors[rows, steps]] = step_values[rows, steps]
    return out


def place_on_anchors(
    step_values: torch.Tensor, outcome: torch.Tensor, layout: StepLayout, length: int
) -> torch.Tensor:
    """Token rewards ``[B, T]``: ``step_values [B, S]`` on their steps' anchors plus ``outcome [B]`` on
    the answer step's anchor (the last step); a response without model tokens gets ``outcome`` on
    token 0. Every method's reward layout is written with this (docs/algorithms.md)."""
    width = layout.max_steps
    if width:
        step_values = step_values * layout.step_mask.to(step_values.dtype)
        last = (layout.num_steps - 1).clamp(min=0)
        has_steps = (layout.num_steps > 0).to(outcome.dtype)
        step_values = step_values.scatter_add(1, last.unsqueeze(1), (outcome * has_steps).unsqueeze(1))
    token = scatter_to_anchors(step_values, layout, length)
    if length:
        token[:, 0] += torch.where(layout.num_steps == 0, outcome, torch.zeros_like(outcome))
    return token


def spread_over_steps(step_values: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """``[B, S]`` → ``[B, T]``: each model token gets its step's value; other tokens get 0."""
    if layout.max_steps and step_values.shape[1] < layout.max_steps:
        raise ValueError(f"step_values has {step_values.shape[1]} steps, the layout {layout.max_steps}")
    out = step_values.new_zeros(layout.token_mask.shape)
    if layout.run_row.numel() == 0:
        return out
    positions, runs = layout.token_runs
    per_run = step_values[layout.run_row, layout.run_step]
    out.view(-1)[positions] = per_run[runs]
    return out
