"""``make compare``'s grid as its driver reads it (docs/compare.md, "On Ray"): the shared part, one job
per cell, the report, split from the registered pipeline (:mod:`spader_pipeline.grid.phases`).

Each job's ``kedro run`` arguments, as the driver hands them to its Ray task, run through the project's
real session and hooks with a runner that records what the job would run and runs no node: the shared
part writes every dataset a cell reads, persisted; a cell reads nothing else; the report reads only what
the jobs before it wrote. Under the driver's hold no job takes a lock of its own. The grid run for real,
on a Ray of two nodes, is tests/grid/test_grid_on_ray.py.
"""

from __future__ import annotations

import pytest
from kedro.framework.project import pipelines
from kedro.framework.session import KedroSession
from kedro.io import MemoryDataset
from kedro.runner import SequentialRunner

from spader_pipeline import run_lock
from spader_pipeline.grid.phases import SHARED, has_work, kedro_args, split
from spader_pipeline.run_lock import CELLS_DIR, LOCK_NAME

#: the test env's design: two seeds (the fewest the design check allows)
CELLS = ["grpo_seed0", "spader_seed0", "grpo_seed1", "spader_seed1"]


def _run_kwargs(args: list[str]) -> dict:
    """``session.run`` arguments of a job's ``kedro run`` arguments (Kedro's CLI maps them so)."""
    assert args[:5] == ["run", "--env", "test", "--pipeline", "compare"] and args[-1] == "--only-missing-outputs"
    option, value = args[5:7]
    names = {"--nodes": "node_names", "--namespaces": "namespaces"}
    return {names[option]: value.split(","), "only_missing_outputs": True}


class Recorded(SequentialRunner):
    """Records the pipeline, the catalog and the data root's locks while it 'runs'; runs no node."""

    def __init__(self, data_root) -> None:
        super().__init__()
        self.data_root = data_root

    def run(self, pipeline, catalog, hook_manager=None, run_id=None, only_missing_outputs=False):
        self.pipeline, self.catalog = pipeline, catalog
        self.cells_locked = sorted(p.stem for p in (self.data_root / CELLS_DIR).glob("*.lock"))
        return {}


def _persisted(recorded: Recorded, names) -> bool:
    return all(recorded.catalog.get(n) is not None and not isinstance(recorded.catalog.get(n), MemoryDataset)
               for n in names)


@pytest.mark.slow
def test_the_grids_jobs_read_only_what_the_jobs_before_them_stored(kedro_project, monkeypatch):
    with (kedro_project / "conf/test/parameters_compare.yml").open("a") as f:
        f.write("  seeds: [0, 1]\n")
    data = kedro_project / "data"
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        context = session.load_context()  # the run's cells, for the registry (CompareCellsHooks)
        grid = split(pipelines["compare"], "compare")
        assert sorted(grid.cells) == sorted(CELLS)
        assert has_work(grid.shared, context.catalog) and all(has_work(p, context.catalog) for p in grid.cells.values())
    assert {"check_compare_design", "warm_start", "select_heldout", "evaluate_references"} <= {
        n.name for n in grid.shared.nodes}
    assert sorted(n.name for n in grid.report.nodes) == ["compare_report", "gather_cells"]

    driver = run_lock.acquire(data, "compare", "test")  # what the driver holds for the grid's life
    monkeypatch.setenv(run_lock.HOLD_ENV, driver.info.token)

    def job(args: list[str]) -> Recorded:
        runner = Recorded(data)
        with KedroSession.create(project_path=kedro_project, env="test") as session:
            session.run(pipeline_names=["compare"], runner=runner, **_run_kwargs(args))
        assert not runner.cells_locked  # a grid's job takes no lock of its own
        return runner

    try:
        # the shared part writes every dataset a cell reads, persisted
        shared = job(kedro_args("test", "compare", nodes=grid.shared))
        assert {n.name for n in shared.pipeline.nodes} == {n.name for n in grid.shared.nodes}
        assert not [n for n in shared.pipeline.nodes if n.namespace]
        written = shared.pipeline.all_outputs()
        cells_wrote: set[str] = set()
        for cell in CELLS:  # each cell's job reads only the shared part
            alone = job(kedro_args("test", "compare", cell=cell))
            assert {n.namespace for n in alone.pipeline.nodes} == {cell}
            reads = {i for i in alone.pipeline.inputs() if not i.startswith("params:")}
            assert reads <= written and _persisted(alone, reads), reads - written
            assert _persisted(alone, {f"{cell}__history", f"{cell}__samples"})
            cells_wrote |= alone.pipeline.all_outputs()
        # the report reads what the shared part and every cell wrote (it runs in the driver, this process)
        report = Recorded(data)
        with KedroSession.create(project_path=kedro_project, env="test") as session:
            session.run(pipeline_names=["compare"], runner=report, node_names=[n.name for n in grid.report.nodes])
        reads = {i for i in report.pipeline.inputs() if not i.startswith("params:")}
        assert {f"{c}__samples" for c in CELLS} <= reads and reads <= written | cells_wrote
        assert _persisted(report, reads)
        assert SHARED not in grid.cells
    finally:
        driver.release()
    assert not (data / LOCK_NAME).exists() and not (data / CELLS_DIR).exists()
