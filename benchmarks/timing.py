"""Paired timings for the benchmarks: each way timed in turn within every repeat (so a slow spell of the
machine falls on all of them), the median per way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def interleaved_medians(ways: dict[str, Callable[..., Any]], repeats: int, sync: Callable[[], None] = lambda: None,
                        prepare: Callable[[], Any] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """Seconds per way (the median over ``repeats``, each way once a repeat, in order) and each way's last
    result. ``sync`` waits for a device's queued work (``torch.cuda.synchronize``), before and after each call;
    ``prepare``, untimed before each call, makes the way's input (the way is called with it)."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for name, way in ways.items():
            arguments = () if prepare is None else (prepare(),)
            sync()
            start = time.perf_counter()
            results[name] = way(*arguments)
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, results


def print_medians(medians: dict[str, float], straightforward: str, ours: str, width: int = 24) -> None:
    """The medians in ms, one line a way, and the straightforward way's over ours."""
    for name, seconds in medians.items():
        print(f"  {name:{width}s} {seconds * 1e3:9.2f} ms")
    print(f"  ratio {medians[straightforward] / medians[ours]:.1f}x")
