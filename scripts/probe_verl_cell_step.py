"""Time a verl cell of ``make positive-control-verl`` step by step, with candidate verl options.

Runs one verl cell's launch as the pipeline does (its typed settings: the native cells' design on verl,
``positive_control_verl.verl``), validation off, for ``--steps`` steps, once per ``--variant`` (a name
and the verl overrides laid over the cell's, last), and prints per step where the time goes (verl's
``timing_s/*``: generation, old log-probs, update, weight sync), the tokens the update took, the
update's loss terms, and the peak memory of the launch's processes (the sum of their proportional set
sizes, sampled every 2 s), with the torch threads verl's workers ran with. The data root's shared part
must exist (``make positive-control``, or its shared part alone).

    PYTHONPATH=src .venv/bin/python scripts/probe_verl_cell_step.py --steps 2 \\
        --variant full= --variant no_checkpointing=actor_rollout_ref.model.enable_gradient_checkpointing=false

A variant is ``NAME=OVERRIDE,OVERRIDE,...`` (``NAME=`` for the cell as configured). Results go to
``--out`` (JSON lines, one per variant), each with its machine load before it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

TIMINGS = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor", "timing_s/update_weights",
           "timing_s/step")
OTHER = ("perf/total_num_tokens", "response_length/mean", "prompt_length/mean", "actor/pg_loss", "actor/grad_norm",
         "actor/entropy", "training/rollout_probs_diff_max", "answer/recall")


class TreeMemory:
    """Peak summed PSS of the processes whose command line names ``marker`` and their descendants, and
    the ``OMP_NUM_THREADS`` each Ray worker saw."""

    def __init__(self, marker: str, every: float = 2.0) -> None:
        self.marker, self.every = marker, every
        self.peak_gb = 0.0
        self.threads: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.every):
            roots = [p for p in psutil.process_iter(["cmdline"]) if self.marker in " ".join(p.info["cmdline"] or ())]
            procs = {p.pid: p for r in roots for p in [r, *_children(r)]}
            total = 0
            for proc in procs.values():
                try:
                    total += proc.memory_full_info().pss
                    name = " ".join(proc.cmdline())[:60]
                    if name.startswith("ray::"):
                        self.threads[name.split()[0]] = proc.environ().get("OMP_NUM_THREADS", "unset")
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.peak_gb = max(self.peak_gb, total / 2**30)


def _children(proc):
    import psutil

    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    return name, [o for o in overrides.split(",") if o]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="positive_control")
    parser.add_argument("--method", default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], help="NAME=OVERRIDE,OVERRIDE,... (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("probe_verl_cell_step.jsonl"))
    parser.add_argument("--keep", action="store_true", help="keep each variant's run folder")
    args = parser.parse_args()

    import mlflow
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    from spader_pipeline.launch.metrics import training_history
    from spader_pipeline.launch.verl import launch_verl_training
    from spader_pipeline.pipelines.positive_control_verl.nodes import verl_cell_settings

    project = Path.cwd()
    bootstrap_project(project)
    with KedroSession.create(project_path=project, env=args.env) as session:
        context = session.load_context()
        params, catalog = context.params, context.catalog
        inputs = {name: catalog.load(name) for name in ("warm_start_manifest", "index_manifest", "fitted_train",
                                                         "fitted_validation")}
    cell = verl_cell_settings(params["training"], params["positive_control_verl"], args.seed)
    cell = cell.with_method(params[f"train_{args.method}"]["method"])
    for text in args.variant or ["as_configured="]:
        name, extra = _variant(text)
        settings = cell.with_changes(verl_overrides=(f"trainer.total_training_steps={args.steps}",
                                                     "trainer.val_before_train=false", "trainer.test_freq=-1", *extra))
        run_dir = Path(tempfile.mkdtemp(prefix=f"probe-{name}-", dir=os.environ.get("PROBE_DIR")))
        load = os.getloadavg()
        mlflow.set_tracking_uri(f"sqlite:///{run_dir}/mlflow.db")
        started = time.monotonic()
        error = None
        with mlflow.start_run(run_name=f"probe {name}"), TreeMemory(str(run_dir)) as memory:
            try:
                launch_verl_training(inputs["warm_start_manifest"], inputs["index_manifest"], settings.verl_launch(),
                                     run_dir / f"train_{args.method}", train=inputs["fitted_train"],
                                     validation=inputs["fitted_validation"])
            except Exception as failed:  # noqa: BLE001 - recorded, the next variant runs
                error = str(failed)[-3000:]
        history = training_history(run_dir / f"train_{args.method}")
        steps = [{k: h[k] for k in (*TIMINGS, *OTHER) if k in h} | {"step": h["step"]} for h in history if h["step"] > 0]
        record = {"variant": name, "overrides": extra, "method": args.method, "steps": steps,
                  "median": {k: statistics.median(s[k] for s in steps if k in s) for k in TIMINGS
                             if any(k in s for s in steps)},
                  "wall_s": round(time.monotonic() - started, 1), "peak_pss_gb": round(memory.peak_gb, 2),
                  "worker_threads": memory.threads, "load_before": [round(x, 2) for x in load],
                  "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  "error": error}
        print(json.dumps(record), flush=True)  # noqa: T201 - the script's output
        with args.out.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
