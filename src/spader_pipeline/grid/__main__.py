"""``python -m spader_pipeline.grid --env ENV --pipeline PIPELINE``: run a grid on Ray (what
``make compare`` and ``make positive-control`` run); ``RAY_ADDRESS`` sends it to a cluster."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .driver import GridFailed, run_grid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spader_pipeline.grid", description=__doc__)
    parser.add_argument("--env", required=True, help="the Kedro environment (conf/<env>)")
    parser.add_argument("--pipeline", required=True, help="a registered pipeline with cells (compare, positive_control)")
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="the project folder (default: here)")
    args = parser.parse_args(argv)
    logging.getLogger("spader_pipeline.grid").setLevel(logging.INFO)
    try:
        outcome = run_grid(args.project, args.env, args.pipeline)
    except GridFailed as failed:
        print(f"grid failed: {failed}", file=sys.stderr)  # noqa: T201 - the command's output
        return 1
    jobs = ", ".join(f"{name} {'stored already' if s is None else f'{s:.0f} s'}" for name, s in outcome.seconds.items())
    killed = f"; runs of killed attempts: {', '.join(outcome.killed_runs)}" if outcome.killed_runs else ""
    print(f"grid {args.pipeline} (env {args.env}) done in {outcome.total_seconds:.0f} s: {jobs}{killed}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
