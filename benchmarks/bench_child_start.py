"""What a heavy stage's child process costs before its work starts: fork server vs spawn.

    .venv/bin/python benchmarks/bench_child_start.py [--calls 5] [--repeats 3] [--smoke]

Every training run, step-0 validation and in-process evaluation runs in a child process
(``spader_pipeline.child_process``), whose target lives in the trainer's or the evaluator's module.
This times ``--calls`` calls of a no-op (``child_start_probe.py``, a module that imports
``spader_pipeline.native.stages`` as a training child's target does) through :func:`in_child_process`:

* **spawn** (the straightforward way): each child is a fresh interpreter that imports torch,
  transformers and the trainer before the call;
* **fork server** (what ``in_child_process`` does): the server imports them once, then each child is
  a fork of it. The first call includes the server's start and imports.

Each arm runs in a fresh Python process (so neither finds the other's server or imports), ``--repeats``
times; reported: the median of each arm's total and of its calls after the first, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import smoke

ARM = """
import json, multiprocessing, sys, time
sys.path.insert(0, sys.argv[3])
from spader_pipeline import child_process
if sys.argv[1] == "spawn":
    child_process._context = lambda: multiprocessing.get_context("spawn")
from child_start_probe import probe
call = child_process.in_child_process(probe)
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def _arm(method: str, calls: int) -> list[float]:
    out = subprocess.run([sys.executable, "-c", ARM, method, str(calls), str(Path(__file__).parent)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5, help="children started per arm (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per arm (default 3)")
    args = smoke.parse_args(parser, calls=2, repeats=1)
    totals: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    later: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    for _ in range(args.repeats):
        for method in totals:
            times = _arm(method, args.calls)
            totals[method].append(sum(times))
            later[method].append(statistics.median(times[1:]) if len(times) > 1 else float("nan"))
    for method in totals:
        print(f"{method:>10}: {args.calls} children {statistics.median(totals[method]):6.2f} s in all, "
              f"a child after the first {statistics.median(later[method]):6.3f} s (medians of {args.repeats})")
    print(f"ratio (spawn / fork server), {args.calls} children: "
          f"{statistics.median(totals['spawn']) / statistics.median(totals['forkserver']):.2f}x")


if __name__ == "__main__":
    main()
