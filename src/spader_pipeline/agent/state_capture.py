"""Boundary states of a rollout, kept per trajectory for the update (docs/training.md).

:class:`StateCapture` is :class:`~spader_pipeline.agent.decode_engine.DecodeEngine`'s bookkeeping for
``capture_states_from_layer``: while the generator runs, a hook appends decoder block ``block``'s
output to the states buffer of the decoding cache
(:func:`~spader_pipeline.modeling.boundary.capture_block_output`); after each generation call the
states of every row's real cached positions are copied out, in order, with their token ids. A
row's cache holds its whole context from position 0 (continued turns keep it, fresh batches encode
it again), so the latest copy of a trajectory covers all its tokens but the last sampled one, which
is never fed to the model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from spader_pipeline.modeling.boundary import capture_block_output

__all__ = ["CapturedStates", "StateCapture"]


@dataclass(frozen=True)
class CapturedStates:
    """What one trajectory's rollout computed at a decoder block, for its leading tokens."""

    token_ids: torch.Tensor
    """long ``[n]``: the trajectory's first ``n`` tokens (CPU)"""
    states: torch.Tensor
    """float32 ``[n, H]``: the block's output at those positions (CPU)"""


class StateCapture:
    """Per trajectory (``RolloutState.uid``), the output of decoder block ``block`` at its tokens.

    ``seconds``: time spent copying states out of caches (the hook's appends are not included;
    they run inside the model's forward).
    """

    def __init__(self, model: Any, block: int) -> None:
        self.model = model
        self.block = block
        self.captured: dict[str, CapturedStates] = {}
        self.started: list[str] = []  # uids in the order the trajectories were started
        self.seconds = 0.0

    @contextmanager
    def hooked(self) -> Iterator[None]:
        """The capture hook on block ``block`` (see the module docstring)."""
        with capture_block_output(self.model, self.block):
            yield

    def record(self, uids: Sequence[str], cache: Any, ids: torch.Tensor, mask: torch.Tensor,
               cache_rows: Sequence[int]) -> bool:
        """Copy each row's states out of ``cache`` after a generation call.

        ``ids``/``mask`` ``[B, L]`` (input row order, ``L`` = the cache length): the token ids of the
        cached positions and 1 where a position holds a real token; ``cache_rows[r]``: the input row
        held by cache row ``r``. ``uids[b]``: the trajectory of input row ``b``. A cache whose states
        do not cover every cached position records nothing for these rows (``False``).
        """
        started = time.perf_counter()
        buffer = getattr(cache, "states", None)
        if buffer is None or buffer.get_seq_length() != cache.get_seq_length() or buffer.states.shape[0] != len(uids):
            self.forget(uids)
            return False
        where = torch.empty(len(uids), dtype=torch.long)
        where[torch.tensor(list(cache_rows))] = torch.arange(len(uids))  # cache row of each input row
        states = buffer.states[where.to(buffer.states.device)]  # [B, L, H], input row order
        real = mask.to(states.device) == 1
        for row, uid in enumerate(uids):
            self.captured[uid] = CapturedStates(
                token_ids=ids[row][real[row].to(ids.device)].cpu(),
                states=states[row][real[row]].float().cpu(),
            )
        self.seconds += time.perf_counter() - started
        return True

    def forget(self, uids: Sequence[str]) -> None:
        """Drop what was captured for ``uids`` (their latest generation call was not captured)."""
        for uid in uids:
            self.captured.pop(uid, None)

    def in_start_order(self) -> list[CapturedStates | None]:
        """The captured states of every started trajectory, in start order (``None``: none)."""
        return [self.captured.get(uid) for uid in self.started]
