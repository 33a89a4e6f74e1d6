"""Length batching: the least-cost blocks of a prefill against every way of cutting the rows."""

from __future__ import annotations

import itertools
import random

import pytest

from spader_pipeline.modeling.batching import padding_blocks


def _cost(lengths, blocks, min_tokens, overhead):
    return sum(max(len(b) * lengths[b.start], min_tokens) + overhead for b in blocks)


def _every_cut(n):
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            edges = [0, *cuts, n]
            yield [range(a, b) for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("seed", range(20))
def test_padding_blocks_is_the_least_cost_cut(seed):
    rng = random.Random(seed)
    lengths = sorted((rng.randint(1, 300) for _ in range(rng.randint(1, 9))), reverse=True)
    min_tokens, overhead = rng.choice([(0, 0), (128, 32), (64, 200)])
    blocks = padding_blocks(lengths, min_tokens=min_tokens, overhead_tokens=overhead)
    assert [i for b in blocks for i in b] == list(range(len(lengths)))  # every row once, in order
    best = min(_cost(lengths, cut, min_tokens, overhead) for cut in _every_cut(len(lengths)))
    assert _cost(lengths, blocks, min_tokens, overhead) == best


def test_padding_blocks_cuts_only_when_it_pays():
    assert padding_blocks([100, 100, 99, 98]) == [range(0, 4)]  # little padding: one forward
    assert padding_blocks([400, 390, 40, 30, 20, 10], min_tokens=128, overhead_tokens=32) == [range(0, 2), range(2, 6)]
    assert padding_blocks([5, 4, 3], min_tokens=0, overhead_tokens=0) == [range(0, 1), range(1, 2), range(2, 3)]
    assert padding_blocks([]) == []
    with pytest.raises(ValueError, match="descending"):
        padding_blocks([1, 2])
