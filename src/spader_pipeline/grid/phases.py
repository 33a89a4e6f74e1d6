"""A registered Kedro pipeline read as a grid: the shared part, the cells, the report.

The cells are the pipeline's namespaces whose nodes are tagged ``cell``
(:data:`~spader_pipeline.run_lock.CELL_TAG`: ``grpo_seed0`` of ``compare``, ``fit_grpo_seed0`` of
``positive_control``); the report is everything downstream of any cell; the shared part is the rest,
what the cells read. Kedro stays the description of the work: the driver runs each part as the
``kedro run`` that its options select (:func:`kedro_args`), and which of them still has work is
Kedro's own ``--only-missing-outputs`` rule (:func:`has_work`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kedro.pipeline import Pipeline

from spader_pipeline.run_lock import CELL_TAG

#: The name of the shared part's job (its Ray task and its MLflow run's ``grid.job`` tag).
SHARED = "shared part"


@dataclass(frozen=True)
class Grid:
    """The three parts of a grid's pipeline; ``cells`` in the pipeline's order."""

    shared: Pipeline
    cells: dict[str, Pipeline]
    report: Pipeline


def split(pipeline: Pipeline, name: str = "") -> Grid:
    """``pipeline`` as shared part, cells and report; a cell that reads another cell's outputs, or a
    pipeline without cells, is refused (the cells must run side by side)."""
    cell_nodes = [n for n in pipeline.nodes if CELL_TAG in n.tags and n.namespace]
    names = list(dict.fromkeys(n.namespace.split(".")[0] for n in cell_nodes))
    if not names:
        raise ValueError(f"pipeline {name!r} has no cells (nodes tagged {CELL_TAG!r} in a namespace): "
                         "there is no grid to run")
    cells = {cell: pipeline.only_nodes_with_namespaces([cell]) for cell in names}
    for cell, part in cells.items():
        others = set().union(*(p.all_outputs() for c, p in cells.items() if c != cell))
        if part.inputs() & others:
            raise ValueError(f"cell {cell} of pipeline {name!r} reads {sorted(part.inputs() & others)}, written by "
                             "other cells: cells must not depend on each other")
    downstream = pipeline.from_nodes(*(n.name for n in cell_nodes))
    return Grid(shared=pipeline - downstream, cells=cells, report=downstream - Pipeline(cell_nodes))


def has_work(pipeline: Pipeline, catalog) -> bool:
    """Whether ``kedro run --only-missing-outputs`` would run any node of ``pipeline``: Kedro's own
    rule, a node without outputs or one with a persisted output missing. The driver asks it first,
    so that a finished part starts no job (and no MLflow run)."""
    for node in pipeline.nodes:
        if not node.outputs:
            return True
        for output in node.outputs:
            if output in catalog and not getattr(catalog.get(output), "_EPHEMERAL", False) \
                    and not catalog.exists(output):
                return True
    return False


def kedro_args(env: str, pipeline_name: str, *, nodes: Pipeline | None = None, cell: str | None = None) -> list[str]:
    """The ``kedro run`` arguments of a grid's job: ``cell`` (``--namespaces``) or ``nodes``
    (``--nodes``), resuming what an earlier run left (``--only-missing-outputs``)."""
    args = ["run", "--env", env, "--pipeline", pipeline_name]
    if cell is not None:
        args += ["--namespaces", cell]
    elif nodes is not None:
        args += ["--nodes", ",".join(sorted(n.name for n in nodes.nodes))]
    return [*args, "--only-missing-outputs"]
