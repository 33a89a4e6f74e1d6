"""Group bookkeeping shared by the group-relative estimators (GRPO, SPA, CalibAdv, TSPO)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["GroupIndex", "group_index"]


class GroupIndex:
    """Dense group ids for a batch: ``ids`` long ``[B]`` in ``[0, num_groups)``, ``sizes`` long ``[G]``."""

    def __init__(self, ids: torch.Tensor, num_groups: int) -> None:
        self.ids = ids
        self.num_groups = num_groups
        self.sizes = torch.bincount(ids, minlength=num_groups)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group sum over the batch axis: ``[B, ...]`` → ``[G, ...]``."""
        out = values.new_zeros((self.num_groups, *values.shape[1:]))
        return out.index_add_(0, self.ids, values)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group mean broadcast back to members: ``[B, ...]`` → ``[B, ...]``."""
        sizes = self.sizes.to(values.dtype).clamp(min=1).view(-1, *([1] * (values.dim() - 1)))
        return (self.sum(values) / sizes)[self.ids]

    def std(self, values: torch.Tensor, *, unbiased: bool) -> torch.Tensor:
        """Per-group standard deviation broadcast back to members (population or N−1).

        With ``unbiased=True`` a singleton group yields NaN, as ``torch.std`` does; callers decide.
        """
        centred = values - self.mean(values)
        sizes = self.sizes.to(values.dtype).view(-1, *([1] * (values.dim() - 1)))
        denom = sizes - 1 if unbiased else sizes
        var = self.sum(centred * centred) / denom
        return var.clamp(min=0).sqrt()[self.ids]


def group_index(
    index: Sequence[object] | np.ndarray | torch.Tensor, device: torch.device | None = None
) -> GroupIndex:
    """Map arbitrary hashable group labels (``uid`` strings, ints) to dense ids, in order of first appearance."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    seen: dict[object, int] = {}
    ids = [
        seen.setdefault(key, len(seen))
        for key in (index.tolist() if isinstance(index, np.ndarray) else index)
    ]
    return GroupIndex(torch.tensor(ids, dtype=torch.long, device=device), len(seen))
