"""The decoding attention over a bf16 cache against fp32 SDPA, per layer (docs/performance.md).

Decoding attends one query position per row over the cache in fp32. The straightforward way is fp32
SDPA over the cache (what decoding ran before the bf16 cache, and still runs where the native extension
does not build); :func:`~spader_pipeline.modeling.decode_attention.decode_attention` runs the native
attention (``spader_native::decode_attention``, modeling/native/decode_step.cpp) over bf16 keys and
values. Both are timed on the same cache views (SmolLM2-135M's attention shape: 9 query heads over 3
key/value heads of 64; ``--length`` cached positions in a buffer with spare room), per row count and
thread count, as the median of ``--repeats`` runs of ``--calls`` calls; the largest difference between
the two is printed beside them. The calls attend over ``--layers`` caches in turn, as a decoding step
reads each of its layers' caches once: at 30 layers (SmolLM2's) and 32 rows the caches outgrow the CPU's, so
each call reads its keys and values from memory as it does in a step; ``--layers 1`` times one cache that
stays in the CPU's caches.

    python benchmarks/bench_decode_attention.py [--rows 1 16 64] [--threads 1 2] [--length 513] [--layers 30] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import smoke
import torch

from spader_pipeline.modeling.decode_attention import decode_attention
from spader_pipeline.modeling.native_step import native_available

HEADS, KV_HEADS, DIM = 9, 3, 64


def cache_view(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """A layer's bf16 keys or values ``[rows, KV_HEADS, length, DIM]``: a view of a buffer with spare room, as
    the cache's."""
    buffer = torch.randn(rows, KV_HEADS, length + 64, DIM, generator=generator).to(torch.bfloat16)
    return buffer[:, :, :length]


def time_calls(layers: list[tuple], native: bool, calls: int, repeats: int) -> float:
    """Median µs per ``decode_attention`` call over ``repeats`` runs of ``calls`` calls (after a warm-up run,
    not counted), call ``i`` over ``layers[i % len(layers)]``."""
    runs = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for call in range(calls):
                decode_attention(*layers[call % len(layers)], native=native)
            runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--length", type=int, default=513, help="cached positions (a 512-token prompt's first step)")
    parser.add_argument("--layers", type=int, default=30, help="caches attended over in turn (SmolLM2 has 30 layers)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = smoke.parse_args(parser, rows=[1, 4], threads=[1], length=33, layers=2, calls=3, repeats=1)
    if not native_available() and args.smoke:
        print("the native extension does not build here: nothing to compare (smoke: not an error)")
        return
    if not native_available():
        raise SystemExit("the native extension does not build here: nothing to compare")
    print(f"per layer, {HEADS} query heads over {KV_HEADS} key/value heads of {DIM}, {args.length} cached positions, "
          f"{args.layers} layers' caches in turn; torch {torch.__version__}")
    print("rows | threads | fp32 SDPA µs | native µs | SDPA / native | largest difference")
    generator = torch.Generator().manual_seed(0)
    for rows in args.rows:
        query = torch.randn(rows, HEADS, 1, DIM, generator=generator)
        layers = [(query, cache_view(rows, args.length, generator), cache_view(rows, args.length, generator), None, 0.125)
                  for _ in range(args.layers)]
        with torch.no_grad():
            difference = max((decode_attention(*inputs, native=True) - decode_attention(*inputs, native=False)).abs().max().item()
                             for inputs in layers[:2])
        for threads in args.threads:
            torch.set_num_threads(threads)
            sdpa = time_calls(layers, False, args.calls, args.repeats)
            native = time_calls(layers, True, args.calls, args.repeats)
            print(f"{rows:4d} | {threads:7d} | {sdpa:12.1f} | {native:9.1f} | {sdpa / native:13.2f} | {difference:.1e}")


if __name__ == "__main__":
    main()
