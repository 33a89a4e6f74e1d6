"""Length-sorted batches: under a padded-token budget (the warm start's SFT, the RL update) and in blocks
of least padding cost (a decoding turn's prefill); and the rows a decoding batch moves behind its going
ones when they finish (:func:`retire_rows`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def token_budget_runs(sorted_lengths: Sequence[int], max_tokens: int | None,
                      max_rows: int | None = None) -> list[range]:
    """Cut rows sorted by ascending length into consecutive runs (index ranges into
    ``sorted_lengths``), each of at most ``max_rows`` rows and at most ``max_tokens`` padded tokens:
    rows × the run's longest (last) length. A row longer than ``max_tokens`` is a run alone;
    ``None`` leaves that bound out.

    Right-padding a run to its longest row then wastes little, and a token budget keeps long rows
    in small runs, where attention's cost (quadratic in the length) and the padding would dominate.
    """
    runs: list[range] = []
    start = 0
    for end, length in enumerate(sorted_lengths):
        rows = end - start + 1  # the run so far, with this row
        if rows > 1 and ((max_rows is not None and rows > max_rows)
                         or (max_tokens is not None and rows * int(length) > max_tokens)):
            runs.append(range(start, end))
            start = end
    if start < len(sorted_lengths):
        runs.append(range(start, len(sorted_lengths)))
    return runs


def padding_blocks(descending_lengths: Sequence[int], *, min_tokens: int = 128, overhead_tokens: int = 32) -> list[range]:
    """Cut rows sorted by descending length into consecutive blocks that each run as one forward,
    padded to the block's first (longest) row, with the least modelled cost.

    A block of ``n`` rows whose longest is ``w`` costs ``max(n * w, min_tokens) + overhead_tokens``
    token positions: padding costs as much as a real token, a forward of fewer than ``min_tokens``
    positions as much as ``min_tokens`` (its matrix products run well under the machine's peak), and
    every forward has a fixed cost (the weights read once more, one dispatch per operation). Exact
    dynamic programme over the cut points, ``O(n²)`` for ``n`` rows. Returns index ranges into
    ``descending_lengths`` covering every row, in order (one range: no cut pays off).
    """
    lengths = [int(x) for x in descending_lengths]
    if any(a < b for a, b in itertools.pairwise(lengths)):
        raise ValueError("padding_blocks needs lengths in descending order")
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of rows [0, j)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows [i, j) as one block, padded to lengths[i]
            cost = best[i] + max((j - i) * lengths[i], min_tokens) + overhead_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    blocks, end = [], n
    while end > 0:
        blocks.append(range(cut[end], end))
        end = cut[end]
    return blocks[::-1]


def retire_rows(finished: list[int], active: int) -> tuple[list[int], list[int]]:
    """Pairs of rows to exchange so that the rows ``finished`` (ascending, each ``< active``) end up
    behind the ``active - len(finished)`` rows that go on: each finished row among the first
    ``active - len(finished)`` with a going row among the rest, in order. Returns ``(holes,
    fillers)``, equally long (both empty when the finished rows are already the last ones)."""
    kept = active - len(finished)
    holes = [row for row in finished if row < kept]
    done = set(finished)
    fillers = [row for row in range(kept, active) if row not in done]
    return holes, fillers
