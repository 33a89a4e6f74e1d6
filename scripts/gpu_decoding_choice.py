"""The decoding path a lease's ``profile`` step chooses for the runs after it (``scripts/gpu_issue63.sh``).

Two choices, each from the benchmark JSON the step just wrote, each kept only where it is clearly faster
(:data:`MARGIN`) than the default it replaces:

* ``launch ATTENTION_JSON``: the Triton attention's launch (``block,warps,stages``) from
  ``benchmarks/bench_gpu_attention.py``'s ways, printed where another launch beats the step's default
  (``SPADER_TRITON_LAUNCH``); nothing printed otherwise;
* ``path PROFILE_JSON GRAPHTESTS_RC STAGE``: the graphs' step with SDPA or the Triton attention, each with
  torch's kernels or the fused ones, the fastest where the gpu-marked graph tests passed on this machine
  (their return code 0), else the graphs with SDPA and torch's kernels; at the rollout's row count (the
  largest of ``benchmarks/bench_gpu_decode_step.py``'s table) for the one-GPU run, written as
  ``STAGE/attention`` and ``STAGE/kernels`` (``SPADER_DECODE_ATTENTION``, ``SPADER_DECODE_KERNELS``), and at
  the rows verl's agent loop sends our server (:data:`SERVER_ROWS` or fewer: the largest such) for verl's
  ``fit()``, written as ``STAGE/server_attention`` and ``STAGE/server_kernels``; both printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: a choice replaces the default only when it is at least this much faster (a repeat's noise is ~1-2%)
MARGIN = 0.97
#: the most requests verl's agent loop sent our server in one batch (the 2026-11-28 lease: 1-8)
SERVER_ROWS = 8
#: the graphs' paths of the decoding benchmark -> (attention, kernels between the products)
PATHS = {"graph": ("sdpa", "aten"), "triton": ("triton", "aten"), "fused": ("sdpa", "triton"),
         "fused_triton": ("triton", "triton")}


def choose_launch(attention: dict) -> str | None:
    """The fastest launch of the Triton attention where it beats the default launch (way ``triton``) by
    :data:`MARGIN`, as ``block,warps,stages``; else ``None``."""
    ways = [way for way in attention.get("ways", []) if way.get("launch") and way.get("ms")]
    default = next((way for way in ways if way["way"] == "triton"), None)
    best = min(ways, key=lambda way: way["ms"], default=None)
    if default and best and best["ms"] < MARGIN * default["ms"]:
        return ",".join(map(str, best["launch"]))
    return None


def choose_path(profile: dict, graph_tests_passed: bool, most_rows: int | None = None) -> tuple[str, tuple[str, str]]:
    """The path of :data:`PATHS` a run decodes with, and its (attention, kernels): the fastest at the largest row
    count timed (of at most ``most_rows``) where the graph tests passed and it beats ``graph`` by :data:`MARGIN`;
    else ``graph``."""
    counts = [row for row in profile.get("rows") or [] if most_rows is None or row.get("rows", 0) <= most_rows]
    row = max(counts, key=lambda r: r.get("rows", 0), default={})
    timed = {path: row[path] for path in PATHS if row.get(path)}
    best = min(timed, key=timed.get, default="graph")
    if not graph_tests_passed or "graph" not in timed or timed[best] >= MARGIN * timed["graph"]:
        best = "graph"
    return best, PATHS[best]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "launch":
        launch = choose_launch(json.loads(Path(argv[1]).read_text()))
        if launch:
            print(launch)
        return 0
    if len(argv) == 4 and argv[0] == "path":
        profile, stage = json.loads(Path(argv[1]).read_text()), Path(argv[3])
        for prefix, most_rows, runs in (("", None, "the one-GPU run"), ("server_", SERVER_ROWS, "verl's server")):
            path, (attention, kernels) = choose_path(profile, argv[2] == "0", most_rows)
            (stage / f"{prefix}attention").write_text(attention + "\n")
            (stage / f"{prefix}kernels").write_text(kernels + "\n")
            print(f"{runs} decodes with: {path} (attention {attention}, kernels {kernels})")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
