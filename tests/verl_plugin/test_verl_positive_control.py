"""``make positive-control-verl`` for real, at the test env's size: the grid of ``positive_control_verl``
on a Ray of its own, its shared part (data, index, the tiny model's warm start, the fitted set), the
native cells, and the verl cells each launching verl's real loop on the CPU (``python -m
verl.trainer.main_ppo``: its FSDP2 actor, our rollout server, its weight sync, a Ray of the cell's own
inside the grid's task), then one report of both trainers.

What it shows:

* each verl cell trains the native cells' design on the same fitted questions and validates them before
  its first step and after its last, under the native cells' names (``val/fitted/recall``,
  ``val/<held-out source>/recall``, ``…/f1``, ``…/searches``); its per-step history carries the native
  trainer's step metrics too (``answer/*``, ``loss/policy``, ``perf/step_seconds``…);
* the report has every cell of both trainers in one table, with a trainer column;
* MLflow folds the verl cells' training runs under the grid run beside the native cells', each with its
  backend tag, the same metric keys for one comparison.

Marked ``verl_workers``: ``make test-verl`` runs it (minutes: a verl launch per verl cell).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import mlflow
import pytest

from spader_pipeline import tracking
from spader_pipeline.pipelines.positive_control.nodes import cell_name
from spader_pipeline.pipelines.positive_control.pipeline import CELLS
from spader_pipeline.pipelines.positive_control_verl.nodes import verl_cell_name
from spader_pipeline.pipelines.positive_control_verl.pipeline import VERL_CELLS as VERL_METHOD_SEEDS

pytest.importorskip("verl")

pytestmark = [pytest.mark.verl_workers, pytest.mark.slow, pytest.mark.e2e]

VERL_CELLS = [verl_cell_name(method, seed) for method, seed in VERL_METHOD_SEEDS]
NATIVE_CELLS = [cell_name(method, seed) for method, seed in CELLS]
#: step metrics the native cells report that a verl cell reports under the same names
SHARED_STEP_METRICS = {"answer/recall", "answer/f1", "rollout/tool_calls", "retrieval/recall", "adv/zero_frac",
                       "group/diverse_frac", "method_reward/mean", "loss/policy", "optim/grad_norm", "policy/entropy",
                       "perf/step_seconds", "perf/rollout_seconds", "perf/update_seconds"}


def test_the_positive_control_through_verl_beside_the_native_cells_in_one_report(kedro_project, tmp_path):
    conf = kedro_project / "conf" / "test"
    (conf / "parameters_positive_control.yml").write_text("positive_control:\n  validation_questions: 2\n")
    # the native cells a share of the cores; a verl cell every core, so one verl run at a time
    (conf / "parameters_grid.yml").write_text(
        f"grid:\n  cell: {{num_cpus: 0.5, memory_gib: 1}}\n  cells:\n    '*_verl_seed*': {{num_cpus: {os.cpu_count()}, memory_gib: 1}}\n")
    since = int(time.time() * 1000)
    log = tmp_path / "grid.log"
    env = {**os.environ, "PYTHONPATH": str(kedro_project / "src")}
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    with log.open("w") as out:
        grid = subprocess.run([sys.executable, "-m", "spader_pipeline.grid", "--env", "test", "--pipeline",
                               "positive_control_verl"], cwd=kedro_project, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=1800)
    output = log.read_text()
    assert grid.returncode == 0, output[-10000:]
    print(f"positive_control_verl at the test env's size: {time.monotonic() - started:.0f} s; {output.splitlines()[-1]}")

    data = kedro_project / "data"
    histories = {cell: json.loads((data / f"07_model_output/{cell}/training_history.json").read_text())
                 for cell in [*NATIVE_CELLS, *VERL_CELLS]}
    steps = max(h["step"] for h in histories["fit_grpo_seed0"])
    native_val = {k for h in histories["fit_grpo_seed0"] for k in h if k.startswith("val/")}
    assert {"val/fitted/recall", "val/fitted/f1", "val/fitted/searches"} <= native_val
    for cell in VERL_CELLS:
        history = histories[cell]
        fitted = [h["step"] for h in history if "val/fitted/recall" in h]
        assert fitted == [0, steps], (cell, fitted)  # verl's own validation before training, and after its last step
        assert {k for h in history for k in h if k.startswith("val/")} >= native_val  # the same names
        trained = {k for h in history if h["step"] > 0 for k in h}
        assert SHARED_STEP_METRICS <= trained, SHARED_STEP_METRICS - trained
        manifest = json.loads((data / f"06_models/{cell}/policy_manifest.json").read_text())
        seed = cell.rsplit("_seed", 1)[1]
        assert manifest["backend"] == "verl" and f"/positive_control/verl/seed{seed}/" in manifest["run_dir"]

    report = (data / "08_reporting/positive_control_verl_report.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in report.splitlines()
            if line.startswith("| fit_")}
    assert rows == {**dict.fromkeys(NATIVE_CELLS, "native"), **dict.fromkeys(VERL_CELLS, "verl")}
    verdicts = [line.split(":")[0] for line in report.splitlines() if line.startswith("- ")]
    assert {"- native", "- verl"} <= set(verdicts), verdicts  # each trainer's verdict

    runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string=f"attributes.start_time >= {since}")
    (grid_run,) = [r for r in runs if r.data.tags.get(tracking.GRID_TAG) == "true"]
    cells = {r.data.tags.get(tracking.GRID_JOB_TAG): r for r in runs
             if r.data.tags.get("mlflow.parentRunId") == grid_run.info.run_id}
    for cell in VERL_CELLS:
        run = cells[cell]
        assert run.data.tags["backend"] == "verl" and run.info.run_name.startswith("positive control verl ")
        assert {"val/fitted/recall", *SHARED_STEP_METRICS} <= set(run.data.metrics)
    assert cells["fit_grpo_seed0"].data.tags["backend"] == "native"
    assert "positive_control_verl/verl/cells" in grid_run.data.metrics
