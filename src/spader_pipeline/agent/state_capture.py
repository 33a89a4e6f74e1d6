"""Boundary states of a rollout, kept per trajectory for the update (docs/training.md).

:class:`StateCapture` is :class:`~spader_pipeline.agent.decode_engine.DecodeEngine`'s bookkeeping for
``capture_states_from_layer``: while the generator runs, a hook appends decoder block ``block``'s
output to the states buffer of the decoding cache
(:func:`~spader_pipeline.modeling.boundary.capture_block_output`); after each generation call the
states of every row's real cached positions are copied out, in order, with their token ids. A
row's cache holds its whole context from position 0 (continued turns keep it, fresh batches encode
it again), so the latest copy of a trajectory covers all its tokens but the last sampled one, which
is never fed to the model.

The copies stay on the cache's device, where the update reads them, and the host waits for the
device once a call, not per row: the positions to keep come from the call's mask, read once, and
each row's states are one gather queued behind the decoding (a rollout on a GPU decodes hundreds
of rows a pass, and the update reads their states there).
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
    """float32 ``[n, H]``: the block's output at those positions (on the decoding cache's device)"""


class StateCapture:
    """Per trajectory (``RolloutState.uid``), the output of decoder block ``block`` at its tokens.

    ``seconds``: time spent copying states out of caches (on a GPU, queueing the copies and reading
    the call's mask; the hook's appends are not included: they run inside the model's forward).
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
        where = [0] * len(uids)  # the cache row of each input row
        for cache_row, row in enumerate(cache_rows):
            where[row] = cache_row
        states = buffer.states  # [b, L, H], cache row order
        real = mask.cpu() == 1  # [B, L]: with the ids, what the host reads of the device
        ids = ids.cpu()
        counts = real.sum(dim=1).tolist()
        positions = real.nonzero(as_tuple=True)[1].to(states.device)  # [N]: each row's real positions in turn
        first = 0
        for row, uid in enumerate(uids):
            take = positions[first : first + counts[row]]
            first += counts[row]
            self.captured[uid] = CapturedStates(token_ids=ids[row][real[row]],
                                                states=states[where[row]].index_select(0, take).float())
        self.seconds += time.perf_counter() - started
        return True

    def forget(self, uids: Sequence[str]) -> None:
        """Drop what was captured for ``uids`` (their latest generation call was not captured)."""
        for uid in uids:
            self.captured.pop(uid, None)

    def in_start_order(self) -> list[CapturedStates | None]:
        """The captured states of every started trajectory, in start order (``None``: none)."""
        return [self.captured.get(uid) for uid in self.started]
