"""A continued turn's cache rearrangements: a row at a time against one indexed copy per buffer.

Before each continued turn :class:`~spader_pipeline.agent.decode_engine.DecodeEngine` puts the cache's rows
back in the input's order (the decoding call left them permuted as rows ended: ``batch_select_indices``) and,
when a tenth of the cache is masked, moves every row's real tokens to its right end (``gather_positions``).
Both rearrange every layer's keys and values and the boundary states
(:class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache`). A row at a time in place keeps a CPU from
faulting in a new buffer; on a GPU it is a launch or more per row and buffer. This times both ways on the
same cache, SmolLM2's (30 layers, 3 key/value heads of 64, bf16; the states 576 wide), and counts the ATen
operations each dispatches, views left out (``dispatch.DispatchCount``;
:data:`~spader_pipeline.modeling.kv_cache.ROW_BY_ROW_DEVICES` decides which way a device takes). Every way leaves the same cache (checked). Median over repeats, each from a fresh copy
of the cache (untimed); on CUDA the time includes waiting for the device.

    python benchmarks/bench_cache_rearrange.py [--rows 768] [--positions 1024] [--device cuda] [--smoke]
"""

from __future__ import annotations

import argparse

import smoke
import torch
from dispatch import DispatchCount
from timing import interleaved_medians, print_medians

from spader_pipeline.modeling import kv_cache
from spader_pipeline.modeling.decode import left_aligned_positions
from spader_pipeline.modeling.kv_cache import GrowingKVCache

LAYERS, KV_HEADS, HEAD_DIM, WIDTH = 30, 3, 64, 576
WAYS = {"a row at a time": frozenset({"cpu", "cuda"}), "one copy a buffer": frozenset()}


def filled_cache(rows: int, positions: int, device: str) -> GrowingKVCache:
    """Random keys (values their negatives) and states, drawn where they live (``torch.manual_seed`` first)."""
    cache = GrowingKVCache(capture_states=True)
    for layer in range(LAYERS):
        keys = torch.randn(rows, KV_HEADS, positions, HEAD_DIM, device=device, dtype=torch.bfloat16)
        cache.update(keys, -keys, layer)
    cache.states.append(torch.randn(rows, positions, WIDTH, device=device, dtype=torch.bfloat16))
    return cache


def rearrange(devices: frozenset, order: torch.Tensor, index: torch.Tensor, cache: GrowingKVCache) -> GrowingKVCache:
    """The rows back in order, then the gaps closed, the way ``devices`` says."""
    saved = kv_cache.ROW_BY_ROW_DEVICES
    kv_cache.ROW_BY_ROW_DEVICES = devices
    try:
        cache.batch_select_indices(order)
        cache.gather_positions(index)
    finally:
        kv_cache.ROW_BY_ROW_DEVICES = saved
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=768)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--masked", type=float, default=0.15, help="share of each row's positions masked")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = smoke.parse_args(parser, rows=8, positions=32, repeats=1)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    template = filled_cache(args.rows, args.positions, args.device)
    order = torch.randperm(args.rows, generator=generator)  # as the ended rows left them
    mask = (torch.rand(args.rows, args.positions, generator=generator) >= args.masked).long()
    mask[:, -1] = 1  # every row holds its last position
    index, _ = left_aligned_positions(mask)
    index = index[:, -int(mask.sum(1).max()):].to(args.device)  # the widest row's real positions, right-aligned

    def fresh() -> GrowingKVCache:
        copy = GrowingKVCache(capture_states=True)
        for number, layer in enumerate(template.layers):
            copy.update(layer.keys.clone(), layer.values.clone(), number)
        copy.states.append(template.states.states.clone())
        return copy

    ways = {name: (lambda cache, devices=devices: rearrange(devices, order, index, cache))
            for name, devices in WAYS.items()}
    medians, results = interleaved_medians(ways, args.repeats, sync, prepare=fresh)
    counts = {}
    for name, devices in WAYS.items():
        cache = fresh()
        with DispatchCount() as counted:
            rearrange(devices, order, index, cache)
        counts[name] = counted.operations
    straightforward, ours = results.values()
    for a, b in zip([*straightforward.layers, straightforward.states], [*ours.layers, ours.states], strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    print(f"{args.rows} rows x {args.positions} positions, {LAYERS} layers ({args.masked:.0%} of each row masked): "
          f"rows reordered, then gaps closed to {index.shape[1]} positions, {args.device}, median of {args.repeats} "
          f"(the same cache both ways)")
    print("  operations dispatched (views left out): " + ", ".join(f"{name} {count:,}" for name, count in counts.items()))
    print_medians(medians, "a row at a time", "one copy a buffer")


if __name__ == "__main__":
    main()
