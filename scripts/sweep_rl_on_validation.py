"""Choose RL hyperparameters on the validation split (issue 32: never on ``embedded_test``).

Trains one method from the environment's warm start once per configuration (``--configs``: ``;``
between configurations, ``,`` between ``key=value`` settings of ``training.native``, e.g.
``learning_rate=3e-4,group_size=16``), each for ``--steps`` RL steps with the environment's other
settings, then scores the final policy greedy on the first ``--val-questions`` questions of the
validation split (RL's turn limits), with a 95% bootstrap interval over questions. Prints one row per
configuration, after a first row for the warm start itself (unless ``--skip-warm-start``): validation recall [CI], F1, searches,
step-1 ``adv/zero_frac`` (groups without an outcome signal), the last step's training recall and the
mean step time and time per trajectory (``total_steps=N`` in a configuration overrides ``--steps``).

Run after ``make compare`` has built the warm start (or ``kedro run --env compare --pipeline
compare --to-nodes validate_warm_start``)::

    PYTHONPATH=src python scripts/sweep_rl_on_validation.py --env compare --steps 6 \\
        --configs "learning_rate=1e-4;learning_rate=3e-4;group_size=16"

The runs go to ``--out`` (one folder per configuration); nothing is written to the Kedro data root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.native import NativeTrainerConfig, train_native
from spader_pipeline.reporting.tables import markdown_table
from spader_pipeline.retrieval.settings import search_backend
from spader_pipeline.typed_config import method_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_warm_start_diversity import _context, greedy_validation  # noqa: E402


def parse_configs(text: str) -> list[dict[str, float | int | str]]:
    """``"a=1,b=2;a=3"`` → ``[{"a": 1, "b": 2}, {"a": 3}]`` (numbers parsed; an empty item = no change)."""
    configs = []
    for item in text.split(";"):
        settings: dict[str, float | int | str] = {}
        for pair in filter(None, (p.strip() for p in item.split(","))):
            key, _, value = pair.partition("=")
            for cast in (int, float):
                try:
                    settings[key.strip()] = cast(value)
                    break
                except ValueError:
                    continue
            else:
                settings[key.strip()] = value.strip()
        configs.append(settings)
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="compare")
    parser.add_argument("--method", default="grpo")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", default="")
    parser.add_argument("--val-questions", type=int, default=49)
    parser.add_argument("--out", default="/tmp/rl_sweep")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-warm-start", action="store_true",
                        help="no warm-start row (it is the same for every sweep of one environment)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = _context(args.env)
    params, catalog = context.params, context.catalog
    training = params["training"]
    start = catalog.load("warm_start_manifest")["path"]
    index_dir = catalog.load("index_manifest")["index_dir"]
    train = catalog.load("verl_train")
    validation = samples_from_verl(catalog.load("verl_validation"))[: args.val_questions]
    template = resolve_template(params["prompt"])
    base = method_settings(training, params[f"train_{args.method}"]["method"], "native")

    rows = []
    with search_backend({"mode": "local"}, index_dir, where="sweep") as search:

        def validate(model_dir, native: dict) -> dict[str, float]:
            """The policy at ``model_dir`` greedy on the validation questions: the table's score columns."""
            model, tokenizer = load_model_and_tokenizer(model_dir)
            with torch.no_grad():
                scores = greedy_validation(model.eval(), tokenizer, validation, search, native, template)
            return {"val_recall": scores["val_recall"], "val_low": scores["val_recall_low"],
                    "val_high": scores["val_recall_high"], "val_f1": scores["val_f1"],
                    "val_searches": scores["val_searches"]}

        if not args.skip_warm_start:
            rows.append({"config": "warm start (no RL)", **validate(start, base)})
            print(json.dumps(rows[-1]), flush=True)
        for k, overrides in enumerate(parse_configs(args.configs)):
            settings = {**base, "total_steps": args.steps, **overrides, "max_seconds": None, "checkpoint_every": 0,
                        "log_samples_every": 0, "resume": False}
            config = NativeTrainerConfig.from_mapping(settings)
            samples = samples_from_verl(train, training.get("max_train_questions"), config.seed)
            started = time.perf_counter()
            result = train_native(config, model_path=start, samples=samples, search=search,
                                  run_dir=Path(args.out) / f"config{k}", prompt_template=template)
            seconds = time.perf_counter() - started
            history = [h for h in result.history if h.get("step", 0) >= 1]
            step_seconds = statistics.mean(h["perf/step_seconds"] for h in history) if history else np.nan
            rows.append({
                "config": ", ".join(f"{key}={value}" for key, value in overrides.items()) or "(environment's)",
                **validate(result.final_model_dir, settings),
                "step1_zero_frac": history[0].get("adv/zero_frac", np.nan) if history else np.nan,
                "train_recall_last": history[-1].get("answer/recall", np.nan) if history else np.nan,
                "step_seconds": step_seconds,
                "seconds_per_trajectory": step_seconds / config.batch_size,
                "run_seconds": seconds,
            })
            print(json.dumps(rows[-1]), flush=True)
    print(markdown_table(pd.DataFrame(rows).round(3)))


if __name__ == "__main__":
    main()
