"""Copying a rollout's boundary states out of the decoding cache: per row to the host against gathers
left on the cache's device.

After each generation call of a native rollout, :class:`~spader_pipeline.agent.state_capture.StateCapture`
keeps every row's states at its real cached positions for the update (docs/training.md).
Straightforward: per row, a boolean index of the row's states and ids and a copy to the host; on a GPU
each waits for the device (the boolean index reads how many positions it selects, the copy waits for
the decoding before it), four times a row. Now (:meth:`StateCapture.record`): the call's mask and ids
read once, each row's states one gather queued on the device, kept there (the update reads them there;
host copies would go back to it).

SmolLM2's width (576 states a position), the one-GPU run's pass (768 rows) and a late turn's context
(1,024 positions, ~10% padding at random); both ways copy the same states (checked). Median over repeats;
on CUDA the time includes waiting for the queued copies.

    python benchmarks/bench_state_capture.py [--rows 768] [--positions 1024] [--device cuda] [--smoke]
"""

from __future__ import annotations

import argparse
import functools

import smoke
import torch
from timing import interleaved_medians, print_medians

from spader_pipeline.agent.state_capture import StateCapture
from spader_pipeline.modeling.kv_cache import GrowingKVCache

WIDTH = 576


def filled_cache(rows: int, positions: int, device: str) -> GrowingKVCache:
    cache = GrowingKVCache(capture_states=True)
    keys = torch.zeros(rows, 1, positions, 8, device=device, dtype=torch.bfloat16)
    cache.update(keys, keys.clone(), 0)
    cache.states.append(torch.randn(rows, positions, WIDTH, device=device))
    return cache


def per_row_to_host(cache: GrowingKVCache, uids: list[str], ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """The straightforward copy: each row's real positions selected and sent to the host, row by row."""
    states = cache.states.states
    real = mask == 1
    return {uid: (ids[row][real[row]].cpu(), states[row][real[row]].float().cpu()) for row, uid in enumerate(uids)}


def gathered_on_device(cache: GrowingKVCache, uids: list[str], ids: torch.Tensor, mask: torch.Tensor) -> dict:
    capture = StateCapture(model=None, block=0)
    assert capture.record(uids, cache, ids, mask, list(range(len(uids))))
    return {uid: (c.token_ids, c.states) for uid, c in capture.captured.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=768)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = smoke.parse_args(parser, rows=8, positions=32, repeats=1)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    cache = filled_cache(args.rows, args.positions, args.device)
    generator = torch.Generator().manual_seed(0)
    mask = (torch.rand(args.rows, args.positions, generator=generator) > 0.1).long().to(args.device)
    ids = torch.randint(3, 49152, (args.rows, args.positions), generator=generator).to(args.device)
    uids = [f"r{row}" for row in range(args.rows)]
    ways = {"per row to the host": per_row_to_host, "gathered on the device": gathered_on_device}
    medians, results = interleaved_medians({name: functools.partial(copy, cache, uids, ids, mask)
                                            for name, copy in ways.items()}, args.repeats, sync)
    straightforward, ours = results.values()
    for uid in uids:
        assert torch.equal(straightforward[uid][0], ours[uid][0].cpu())
        assert torch.equal(straightforward[uid][1], ours[uid][1].cpu())
    print(f"states of {args.rows} rows x {args.positions} positions x {WIDTH} copied out of the cache, {args.device}, "
          f"median of {args.repeats} (the same states both ways)")
    print_medians(medians, "per row to the host", "gathered on the device")

if __name__ == "__main__":
    main()
