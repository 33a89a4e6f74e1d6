"""docs/compare.md's recipe for running the comparison as separate jobs, as written: the shared
part, then one ``kedro run --namespaces <cell>`` per cell, side by side on one data root, then the
report.

The default test runs the documented commands (read from the page) through the project's real
session and hooks with a runner that records what each would run and which locks it holds, and
runs no node: the shared part writes every dataset a cell reads, persisted; a cell reads nothing
else; two cell jobs in two processes hold their cells at once, and the report reads only what the
phases before it wrote. Training the cells for real in separate processes costs minutes per job on
two cores; ``SPADER_TEST_JOBS=1`` adds that run (tiny model, test env, two cells at a time), which
also checks every cell job's MLflow run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from kedro.framework.session import KedroSession
from kedro.io import MemoryDataset
from kedro.runner import SequentialRunner

from spader_pipeline.run_lock import CELLS_DIR, LOCK_NAME

DOC = Path(__file__).resolve().parents[3] / "docs" / "compare.md"
#: the test env's design: two seeds (the fewest the design check allows)
CELLS = ["grpo_seed0", "spader_seed0", "grpo_seed1", "spader_seed1"]


def _recipe() -> dict[str, list[str]]:
    """The three phases' ``kedro run`` arguments from docs/compare.md (after ``--pipeline compare``)."""
    commands = re.findall(r"`kedro run --env compare --pipeline compare (--[^`]+)`", DOC.read_text())
    phases = {"shared": [c for c in commands if c.startswith("--to-nodes")],
              "cell": [c for c in commands if c == "--namespaces <cell>"],
              "report": [c for c in commands if c.startswith("--nodes")]}
    assert all(len(found) == 1 for found in phases.values()), phases
    return {phase: found[0].split() for phase, found in phases.items()}


def _run_kwargs(args: list[str], cell: str = "") -> dict[str, list[str]]:
    """``session.run`` arguments of the CLI options the recipe uses (Kedro's CLI maps them so)."""
    names = {"--to-nodes": "to_nodes", "--nodes": "node_names", "--namespaces": "namespaces"}
    return {names[option]: value.replace("<cell>", cell).split(",") for option, value in zip(args[::2], args[1::2], strict=True)}


class Recorded(SequentialRunner):
    """Records the pipeline, the catalog and the data root's locks while it 'runs'; runs no node."""

    def __init__(self, data_root: Path) -> None:
        super().__init__()
        self.data_root = data_root

    def run(self, pipeline, catalog, hook_manager=None, run_id=None, only_missing_outputs=False):
        self.pipeline, self.catalog = pipeline, catalog
        self.root_locked = (self.data_root / LOCK_NAME).exists()
        self.cells_locked = sorted(p.stem for p in (self.data_root / CELLS_DIR).glob("*.lock"))
        return {}


def _session_run(project: Path, env: str, **run_kwargs) -> Recorded:
    runner = Recorded(project / "data")
    with KedroSession.create(project_path=project, env=env) as session:
        session.run(pipeline_names=["compare"], runner=runner, **run_kwargs)
    return runner


def _persisted(recorded: Recorded, names) -> bool:
    return all(recorded.catalog.get(n) is not None and not isinstance(recorded.catalog.get(n), MemoryDataset)
               for n in names)


#: another process: one cell job through the project's hooks, holding its cell until the file
#: named by argv[4] exists (it writes argv[3] once it holds its cell)
CELL_JOB = """
import sys, time
from pathlib import Path
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from kedro.runner import SequentialRunner

project, cell, holding, release = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])

class Holding(SequentialRunner):
    def run(self, pipeline, catalog, hook_manager=None, run_id=None, only_missing_outputs=False):
        holding.write_text(",".join(sorted({n.namespace for n in pipeline.nodes})))
        while not release.exists():
            time.sleep(0.05)
        return {}

bootstrap_project(project)
with KedroSession.create(project_path=project, env="test") as session:
    session.run(pipeline_names=["compare"], namespaces=[cell], runner=Holding())
"""


@pytest.mark.slow
def test_the_separate_jobs_recipe_runs_as_written(kedro_project, tmp_path_factory):
    recipe = _recipe()
    with (kedro_project / "conf/test/parameters_compare.yml").open("a") as f:
        f.write("  seeds: [0, 1]\n")
    data = kedro_project / "data"

    # 1. the shared part: holds the whole root, writes every dataset a cell reads, persisted
    shared = _session_run(kedro_project, "test", **_run_kwargs(recipe["shared"]))
    assert shared.root_locked and not shared.cells_locked
    assert not [n for n in shared.pipeline.nodes if n.namespace]
    written = shared.pipeline.all_outputs()

    # 2. the cells, two jobs in two processes at once, then each cell's own job reads only the shared part
    signals = tmp_path_factory.mktemp("signals")
    job = subprocess.Popen([sys.executable, "-c", CELL_JOB, str(kedro_project), "spader_seed1",
                            str(signals / "holding"), str(signals / "release")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(6000):  # until the other process holds its cell
            if (signals / "holding").exists():
                break
            assert job.poll() is None, job.communicate()[0][-5000:]
            time.sleep(0.1)
        assert (signals / "holding").read_text() == "spader_seed1"
        beside = _session_run(kedro_project, "test", **_run_kwargs(recipe["cell"], "grpo_seed0"))
        assert beside.cells_locked == ["grpo_seed0", "spader_seed1"] and not beside.root_locked
        holder = json.loads((data / CELLS_DIR / "spader_seed1.lock").read_text())
        assert holder["pid"] == job.pid and holder["cells"] == ["spader_seed1"]
    finally:
        (signals / "release").touch()
        output, _ = job.communicate(timeout=600)
    assert job.returncode == 0, output[-5000:]

    cells_wrote: set[str] = set()
    for cell in CELLS:
        alone = _session_run(kedro_project, "test", **_run_kwargs(recipe["cell"], cell))
        assert {n.namespace for n in alone.pipeline.nodes} == {cell} and alone.cells_locked == [cell]
        reads = {i for i in alone.pipeline.inputs() if not i.startswith("params:")}
        assert reads <= written and _persisted(alone, reads), reads - written
        assert _persisted(alone, {f"{cell}__history", f"{cell}__samples"})
        cells_wrote |= alone.pipeline.all_outputs()

    # 3. the report: holds the whole root, reads what the shared part and every cell wrote
    report = _session_run(kedro_project, "test", **_run_kwargs(recipe["report"]))
    assert report.root_locked and not report.cells_locked
    reads = {i for i in report.pipeline.inputs() if not i.startswith("params:")}
    assert {f"{c}__samples" for c in CELLS} <= reads and reads <= written | cells_wrote
    assert _persisted(report, reads)
    assert not (data / LOCK_NAME).exists() and not list((data / CELLS_DIR).glob("*.lock"))


# --- the same recipe with real training, on demand (minutes per job on two cores) ---

def _kedro(project: Path, args: list[str]) -> subprocess.Popen:
    """``kedro run --env test --pipeline compare <args>`` in its own process, on a short design."""
    command = [sys.executable, "-m", "kedro", "run", "--env", "test", "--pipeline", "compare",
               "--params", "compare.max_questions=4,training.native.total_steps=1", *args]
    return subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(project / "src")})


def _wait(*jobs: subprocess.Popen) -> None:
    for job in jobs:
        output, _ = job.communicate(timeout=3600)
        assert job.returncode == 0, output[-5000:]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPADER_TEST_JOBS") != "1", reason="set SPADER_TEST_JOBS=1: trains every cell")
def test_the_separate_jobs_recipe_trains_every_cell_in_its_own_process(kedro_project):
    recipe = _recipe()
    since = f"attributes.start_time >= {int(time.time() * 1000)}"
    with (kedro_project / "conf/test/parameters_compare.yml").open("a") as f:
        f.write("  seeds: [0, 1]\n")
    _wait(_kedro(kedro_project, recipe["shared"]))
    for first, second in (CELLS[:2], CELLS[2:]):
        _wait(_kedro(kedro_project, ["--namespaces", first]), _kedro(kedro_project, ["--namespaces", second]))
    _wait(_kedro(kedro_project, recipe["report"]))

    data = kedro_project / "data"
    assert sorted(json.loads((data / "07_model_output/compare_runs.json").read_text())) == sorted(CELLS)
    samples = pd.read_json(data / "07_model_output/compare_eval_samples.jsonl", lines=True)
    assert set(samples["model"]) == {"warm_start", "scripted", *CELLS}
    assert "SPADER vs GRPO" in (data / "08_reporting/compare_report.md").read_text()
    # every cell job created its cell's MLflow run, with the cell's held-out scores
    cells = mlflow.search_runs(search_all_experiments=True, output_format="list",
                               filter_string=f"tags.chain_kind = 'compare' and {since}")
    assert sorted(r.info.run_name for r in cells) == sorted(f"compare {c.replace('_seed', ' seed')}" for c in CELLS)
    assert all(r.info.status == "FINISHED" and "heldout/embedded_test/recall" in r.data.metrics for r in cells)
