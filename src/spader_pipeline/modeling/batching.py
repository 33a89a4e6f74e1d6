"""Length-sorted batches under a padded-token budget, for the warm start's SFT and the RL update."""

from __future__ import annotations

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
