"""The ``compare`` pipeline: data, index and base model as in the default chain, the design check,
the shared warm start and the held-out questions, then one namespace per method × seed (a *cell*:
train → merge → evaluate, writing the cell's per-question records), then the report gathering
every cell.

The cells come from ``compare.methods`` × ``compare.seeds`` in ``conf/`` at registry time (Kedro's
dynamic pipelines): :func:`registered_cells` reads them with the project's config loader, so
``seeds: [0, 1, 2, 3, 4]`` in ``parameters_compare.yml`` adds cells. One cell runs alone with
``kedro run --env compare --pipeline compare --namespaces grpo_seed0`` (docs/compare.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial, update_wrapper
from pathlib import Path

from kedro.pipeline import Pipeline, node, pipeline

from spader_pipeline.pipelines.base_model import create_pipeline as base_model_pipeline
from spader_pipeline.pipelines.data_prep import create_pipeline as data_prep_pipeline
from spader_pipeline.pipelines.index_build import create_pipeline as index_build_pipeline
from spader_pipeline.pipelines.merge.nodes import merge_policy
from spader_pipeline.pipelines.training.nodes import train_policy
from spader_pipeline.pipelines.training.pipeline import warm_start_pipeline
from spader_pipeline.tracking import METHOD_RUN_TAG

from . import nodes

#: The environment whose ``compare`` block defines the cells when ``KEDRO_ENV`` is not set.
DESIGN_ENV = "compare"
#: Datasets every cell reads from outside its namespace (all persisted: a cell runs alone).
CELL_INPUTS = {"warm_start_manifest", "warm_start_validation", "verl_train", "verl_validation", "index_manifest",
               "compare_heldout"}
CELL_PARAMS = {"params:training", "params:merge", "params:evaluate", "params:prompt", "params:compare.output_dir",
               "params:compare.evaluation"}


def registered_cells(project_path: Path | None = None, env: str | None = None) -> list[tuple[str, int]]:
    """``compare.methods`` × ``compare.seeds`` of ``env`` (default: ``$KEDRO_ENV``, else ``compare``)
    read with the project's config loader, seed-major."""
    from kedro.framework.project import settings
    from omegaconf.basecontainer import BaseContainer

    conf = Path(project_path or Path.cwd()) / settings.CONF_SOURCE
    args = {**settings.CONFIG_LOADER_ARGS, "env": env or os.environ.get("KEDRO_ENV") or DESIGN_ENV}
    # A config loader registers its ``globals`` resolver process-wide; the running session's
    # loader (possibly another environment) must keep resolving the catalog, so it is put back.
    resolvers = dict(BaseContainer._resolvers)
    try:
        compare = settings.CONFIG_LOADER_CLASS(conf_source=str(conf), **args)["parameters"].get("compare") or {}
    finally:
        BaseContainer._resolvers.clear()
        BaseContainer._resolvers.update(resolvers)
    return [(str(m), int(s)) for s in compare.get("seeds") or [] for m in compare.get("methods") or []]


def _bound(func, **kwargs):
    """``func`` with ``kwargs`` fixed at registry time (a cell's method and seed), keeping its name."""
    return update_wrapper(partial(func, **kwargs), func)


def cell_pipeline(method: str, seed: int) -> Pipeline:
    """One method × seed under the namespace :func:`nodes.cell_name`; it exposes its per-step
    history and per-question records as ``<cell>__history`` / ``<cell>__samples``."""
    name = nodes.cell_name(method, seed)
    template = Pipeline(
        [
            node(_bound(nodes.cell_settings, seed=seed),
                 ["params:training", "params:merge", "params:compare.output_dir"],
                 ["training_settings", "merge_settings"], name="cell_settings"),
            node(train_policy,
                 ["warm_start_manifest", "verl_train", "index_manifest", "params:method", "training_settings",
                  "params:prompt", "verl_validation", "warm_start_validation"],
                 ["policy_manifest", "training_history", "training_metrics"],
                 name="train_policy", tags=[METHOD_RUN_TAG]),
            node(merge_policy, ["policy_manifest", "merge_settings"], "model_manifest", name="merge_policy"),
            node(_bound(nodes.evaluate_cell, method=method, seed=seed),
                 ["model_manifest", "compare_heldout", "index_manifest", "params:evaluate",
                  "params:compare.evaluation", "params:prompt"],
                 "eval_samples", name="evaluate_cell"),
        ],
        tags=["compare", "compare_cell"],
    )
    return pipeline(template, namespace=name, inputs=CELL_INPUTS,
                    parameters={**{p: p for p in CELL_PARAMS}, "params:method": f"params:train_{method}.method"},
                    outputs={"training_history": f"{name}__history", "eval_samples": f"{name}__samples"})


def create_pipeline(cells: Sequence[tuple[str, int]] | None = None, **kwargs) -> Pipeline:
    """``cells``: (method, seed) pairs (default: :func:`registered_cells`)."""
    cells = registered_cells() if cells is None else list(cells)
    shared = Pipeline(
        [
            node(_bound(nodes.check_design, cells=tuple(cells)), ["eval_sets", "params:compare"], "compare_design",
                 name="check_compare_design"),
            node(nodes.select_heldout,
                 ["compare_design", "eval_sets", "corpus", "params:evaluate", "params:compare.evaluation"],
                 "compare_heldout", name="select_heldout"),
            node(nodes.evaluate_references,
                 ["warm_start_manifest", "compare_heldout", "index_manifest", "params:evaluate",
                  "params:compare.evaluation", "params:prompt"],
                 ["compare_reference_samples", "compare_reference_metrics"], name="evaluate_references"),
        ],
        tags="compare",
    )
    gathered = {f"{nodes.cell_name(m, s)}__{part}": f"{nodes.cell_name(m, s)}__{part}"
                for m, s in cells for part in ("history", "samples")}
    report = Pipeline(
        [
            node(nodes.gather_cells, {"design": "compare_design", "reference_samples": "compare_reference_samples",
                                      **gathered},
                 ["compare_runs", "compare_eval_samples"], name="gather_cells"),
            node(nodes.write_report,
                 ["compare_design", "compare_runs", "compare_eval_samples", "params:compare", "params:training"],
                 ["compare_report", "compare_curves", "compare_metrics"], name="compare_report"),
        ],
        tags="compare",
    )
    # the design is checked before the warm start trains
    warm = warm_start_pipeline()
    fanout = sum((cell_pipeline(m, s) for m, s in cells), Pipeline([]))
    return (data_prep_pipeline() + index_build_pipeline() + base_model_pipeline() + shared + warm + fanout
            + report)
