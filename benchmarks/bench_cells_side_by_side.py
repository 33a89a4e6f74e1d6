"""Two RL cells side by side with half the cores each, vs one cell after the other with every core.

    .venv/bin/python benchmarks/bench_cells_side_by_side.py [--steps 2]
        [--data-root data/positive_control] [--cell-config <run dir>/config.json]
    .venv/bin/python benchmarks/bench_cells_side_by_side.py --smoke   (one step of the tiny model at 2 x 2)

A cell of ``make positive-control`` or ``make compare`` is one native training run. On a CPU its step
is mostly decoding (memory-bound) and the update's small matrix products, which two threads of one
process share less well than two processes of one thread each. This runs the same cell settings
(default: ``make positive-control``'s GRPO seed 0, its ``config.json``) for ``--steps`` steps:

* **one after the other**: seed 0, then seed 1, each in its own process with every core's thread;
* **side by side**: seeds 0 and 1 started together, each process with half the threads.

Each run is a fresh process (``python -m spader_pipeline.native``) from the same warm start on the
same fitted questions, no validation, no checkpoint. Reported: the wall time of each arm and
steps per minute; the ratio is the side-by-side arm's throughput over the other's. One repeat of
each arm by default (a step takes 1-3 minutes here); the arms see the same seeds, so the same
questions, but sampling differs with the thread count, so the trajectories' lengths differ a
little: the per-step model tokens are printed beside the times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import smoke

ROOT = Path(__file__).resolve().parents[1]


def _spec(data_root: Path, cell_config: Path | None, steps: int, seed: int, out: Path) -> Path:
    """The run's ``--spec`` file; ``cell_config`` ``None`` (``--smoke``): benchmarks/smoke.py's inputs and
    trainer settings (the tiny model, a small index, 2 x 2 trajectories of two short turns)."""
    import pandas as pd
    import yaml

    from spader_pipeline.agent.prompts import resolve_template
    from spader_pipeline.data.formats import samples_from_verl

    if cell_config is None:
        config, questions = smoke.trainer_settings(), smoke.questions(4)
        model, index, template = str(smoke.model_dir()), str(smoke.index_dir()), smoke.prompt_template()
    else:
        config = json.loads(cell_config.read_text())
        fitted = pd.read_parquet(data_root / "05_model_input/positive_control/fitted_train.parquet")
        questions = [dict(s) for s in samples_from_verl(fitted)]
        template = resolve_template(yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"])
        versions = sorted((data_root / "06_models/retrieval/index_manifest.json").iterdir())  # a versioned dataset
        index = json.loads((versions[-1] / "index_manifest.json").read_text())["index_dir"]
        model = str(data_root / "06_models/warm_start")
    config["reward"].pop("enable_exploration", None)  # the method's, recorded in config.json, not a setting
    config.update(total_steps=steps, seed=seed, checkpoint_every=0, log_samples_every=0, resume=False,
                  max_seconds=None)
    samples = out / "questions.jsonl"
    samples.write_text("".join(json.dumps(q, default=list) + "\n" for q in questions))
    spec = {"config": config, "model_path": model, "samples": str(samples), "index_dir": index,
            "run_dir": str(out / f"seed{seed}"), "prompt_template": template}
    path = out / f"spec_seed{seed}.json"
    path.write_text(json.dumps(spec))
    return path


def _start(spec: Path, threads: int, log: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    process = subprocess.Popen([sys.executable, "-m", "spader_pipeline.native", "--spec", str(spec)], env=env,
                               stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    return process, log


def _wait(runs: list[tuple[subprocess.Popen, Path]]) -> None:
    for process, log in runs:
        if process.wait() != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise SystemExit(f"a run failed (exit {process.returncode}); the end of its log:\n{tail}")


def _model_tokens(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["rollout/model_tokens"] for row in rows if row.get("step", 0) > 0 and "rollout/model_tokens" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--data-root", type=Path, default=ROOT / "data/positive_control")
    parser.add_argument("--cell-config", type=Path, default=None,
                        help="a cell's config.json (default: <data-root>/06_models/positive_control/seed0/train_grpo/)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the machine's threads to share")
    args = smoke.parse_args(parser, steps=1)  # --smoke: the tiny model, 2 x 2 trajectories of 2 short turns
    cell_config = None if args.smoke and not args.cell_config else (
        args.cell_config or args.data_root / "06_models/positive_control/seed0/train_grpo/config.json")
    half = max(1, args.threads // 2)
    with tempfile.TemporaryDirectory(prefix="bench_cells_") as tmp:
        results = {}
        for arm in ("one after the other", "side by side"):
            out = Path(tmp) / arm.replace(" ", "_")
            out.mkdir()
            specs = [_spec(args.data_root, cell_config, args.steps, seed, out) for seed in (0, 1)]
            start = time.perf_counter()
            if arm == "side by side":
                _wait([_start(spec, half, out / f"log{k}.txt") for k, spec in enumerate(specs)])
            else:
                for k, spec in enumerate(specs):
                    _wait([_start(spec, args.threads, out / f"log{k}.txt")])
            seconds = time.perf_counter() - start
            tokens = [_model_tokens(out / f"seed{seed}") for seed in (0, 1)]
            results[arm] = seconds
            print(f"{arm}: {seconds:.0f} s for 2 x {args.steps} steps, {2 * args.steps / seconds * 60:.2f} steps/min; "
                  f"model tokens per trajectory by step: seed 0 {[round(t) for t in tokens[0]]}, "
                  f"seed 1 {[round(t) for t in tokens[1]]}", flush=True)
        ratio = results["one after the other"] / results["side by side"]
        print(f"side by side ({half} thread(s) each) vs one after the other ({args.threads}): {ratio:.2f}x the throughput")


if __name__ == "__main__":
    main()
