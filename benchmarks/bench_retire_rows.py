"""Retiring the rows that ended at a decoding step: all at once against one swap per row.

When rows of a batch end their turn, :func:`~spader_pipeline.modeling.decode.decode_batch` moves them
behind the rows that go on, in every layer of the :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache`
(and its captured states). Straightforward: one two-row swap per ended row
(:meth:`GrowingKVCache.swap_rows`, ~4 small operations per layer each). Now: the step's pairs in one
permutation (:func:`~spader_pipeline.modeling.decode.retire_rows`, :meth:`GrowingKVCache.move_rows`),
one gather and one scatter per buffer whatever the number of rows. A rollout retires every row once
per turn (256 rows x 6 turns per RL step of conf/one_gpu), and a GPU decoding step is bound by such
small operations' launches (docs/gpu.md), so the count of operations is what matters there.

SmolLM2-135M's cache shape (30 layers, 3 KV heads of 64, captured states of 576), short caches so
that the copy itself is small, as it is next to a GPU's bandwidth. Median over repeats.

    python benchmarks/bench_retire_rows.py [--rows 256] [--ended 32] [--positions 64] [--device cpu] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import smoke
import torch

from spader_pipeline.modeling.decode import retire_rows
from spader_pipeline.modeling.kv_cache import GrowingKVCache


def filled_cache(rows: int, positions: int, device: str) -> GrowingKVCache:
    cache = GrowingKVCache(capture_states=True)
    for layer in range(30):
        keys = torch.randn(rows, 3, positions, 64, device=device, dtype=torch.bfloat16)
        cache.update(keys, keys.clone(), layer)
    cache.states.append(torch.randn(rows, positions, 576, device=device))
    return cache


def one_swap_per_row(cache: GrowingKVCache, ended: list[int], active: int) -> None:
    for row in reversed(ended):
        active -= 1
        if row != active:
            cache.swap_rows(row, active)


def all_at_once(cache: GrowingKVCache, ended: list[int], active: int) -> None:
    holes, fillers = retire_rows(ended, active)
    if holes:
        cache.move_rows(torch.tensor(holes + fillers), torch.tensor(fillers + holes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--ended", type=int, default=32)
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = smoke.parse_args(parser, rows=16, ended=4, positions=8, repeats=2)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    cache = filled_cache(args.rows, args.positions, args.device)
    rng = random.Random(0)
    times = {"one swap per row": [], "all at once": []}
    for _ in range(args.repeats):
        ended = sorted(rng.sample(range(args.rows), args.ended))
        for name, retire in (("one swap per row", one_swap_per_row), ("all at once", all_at_once)):
            sync()
            start = time.perf_counter()
            retire(cache, ended, args.rows)
            sync()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.ended} of {args.rows} rows retired, {args.positions} cached positions, 30 layers + states, "
          f"{args.device}, median of {args.repeats}")
    for name, seconds in medians.items():
        print(f"  {name:18s} {seconds * 1e3:8.2f} ms")
    print(f"  ratio {medians['one swap per row'] / medians['all at once']:.1f}x")


if __name__ == "__main__":
    main()
