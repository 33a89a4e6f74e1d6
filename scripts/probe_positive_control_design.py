"""Choose ``make positive-control``'s training design on validation seeds and validation draws (rule 12).

The positive control's verdict is read on RL seeds 0 and 1 and on the sampled gauge's draws
(``training.validation.seed``). A design (learning rate, steps, …) chosen on those same seeds and draws
would be fitted to the noise it is judged by, so this script trains the fitted questions exactly as a
cell does (:func:`spader_pipeline.pipelines.positive_control.nodes.cell_settings`, the native backend,
the environment's every other setting) but on other RL seeds (``--seeds``, default 2) and scores the
fitted questions with other draws (``--draw-seed``, default 1000; ``--draws`` trajectories per question
at the gauge's temperature). Only the fitted rows are scored (no greedy repeat, no held-out rows).

``--configs``: ``;`` between configurations, ``,`` between ``key=value`` settings of ``training.native``
(as ``scripts/sweep_rl_on_validation.py``). One JSON line per configuration × seed: the fitted F1 and
recall at step 0 and at each validation step, the gain, the training reward per step and the policy's
movement (``policy/approx_kl``, ``policy/entropy``), and the step time. Run one process per core::

    PYTHONPATH=src python scripts/probe_positive_control_design.py --configs "learning_rate=3e-4" --out /tmp/d1
    PYTHONPATH=src python scripts/probe_positive_control_design.py --configs "learning_rate=1e-3" --out /tmp/d2

after ``make positive-control`` (or its shared part) has built the warm start and the fitted set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from spader_pipeline.pipelines.positive_control.nodes import cell_settings, start_validation_settings
from spader_pipeline.pipelines.training.nodes import validate_warm_start
from spader_pipeline.reporting.positive_control import FITTED_SOURCE
from spader_pipeline.training import TrainingSettings, get_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_warm_start_diversity import _context  # noqa: E402
from sweep_rl_on_validation import parse_configs  # noqa: E402

CURVE_KEYS = ("answer/f1", "policy/approx_kl", "policy/entropy", "perf/step_seconds")


def probe_training(training: dict, native: dict, args: argparse.Namespace) -> dict:
    """``training`` with the configuration's native settings and the probe's gauge: validation draws of
    their own, scored every ``--every`` steps, no child process (one thread per probe)."""
    validation = {**training.get("validation", {}), "every": args.every, "before_train": True,
                  "max_questions": None, "trajectories": {FITTED_SOURCE: args.draws}, "seed": args.draw_seed}
    if args.temperature is not None:
        validation["temperature"] = args.temperature
    return {**training, "subprocess": False, "validation": validation,
            "native": {**training["native"], "total_steps": args.steps, "max_seconds": None, "checkpoint_every": 0,
                       "log_samples_every": 0, "resume": False, **native}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="positive_control")
    parser.add_argument("--method", default="grpo")
    parser.add_argument("--configs", default="")
    parser.add_argument("--seeds", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--draw-seed", type=int, default=1000)
    parser.add_argument("--temperature", type=float, default=None, help="the gauge's (default: the environment's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = _context(args.env)
    params, catalog = context.params, context.catalog
    fitted_train = catalog.load("fitted_train")
    validation = catalog.load("fitted_validation")
    fitted_rows = validation[validation["data_source"] == FITTED_SOURCE].reset_index(drop=True)
    warm, index = catalog.load("warm_start_manifest"), catalog.load("index_manifest")
    method = params[f"train_{args.method}"]["method"]
    out = Path(args.out)

    start = None
    for overrides in parse_configs(args.configs):
        training = probe_training(params["training"], overrides, args)
        if start is None:  # the warm start on the probe's draws: step 0 of every configuration
            start = validate_warm_start(warm, fitted_rows, index, start_validation_settings(training), params["prompt"])
        for seed in args.seeds:
            settings = TrainingSettings.from_mapping(cell_settings(training, str(out), seed), method)
            began = time.perf_counter()
            _, history = get_backend(settings.backend).train(
                settings, init_manifest=warm, index_manifest=index, verl_train=fitted_train,
                verl_validation=fitted_rows, start_validation=start, template=settings.template(params["prompt"]))
            scored = [h for h in history if f"val/{FITTED_SOURCE}/f1" in h]
            steps = [h for h in history if h.get("step", 0) >= 1]
            row = {
                "method": args.method, "config": overrides, "seed": seed, "draws": args.draws,
                "draw_seed": args.draw_seed,
                "fitted_f1": {int(h["step"]): round(h[f"val/{FITTED_SOURCE}/f1"], 4) for h in scored},
                "fitted_recall": {int(h["step"]): round(h[f"val/{FITTED_SOURCE}/recall"], 4) for h in scored},
                "gain_f1": round(scored[-1][f"val/{FITTED_SOURCE}/f1"] - scored[0][f"val/{FITTED_SOURCE}/f1"], 4),
                **{key: [round(h.get(key, float("nan")), 4) for h in steps] for key in CURVE_KEYS},
                "median_step_seconds": round(statistics.median(h["perf/step_seconds"] for h in steps), 1),
                "run_seconds": round(time.perf_counter() - began, 1),
            }
            print(json.dumps(row), flush=True)
            with (out / "probe.jsonl").open("a") as handle:
                handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
