"""The ``compare`` pipeline: data, index and base model as in the default chain, the design check,
the shared warm start and the held-out questions, then one namespace per method × seed (a *cell*:
train → merge → evaluate, writing the cell's per-question records), then the report gathering
every cell.

The cells are ``compare.methods`` × ``compare.seeds`` of the run's parameters, passed to
:func:`create_pipeline` when Kedro loads the pipeline registry (Kedro's dynamic pipelines). Kedro
loads it inside ``session.run``, right after the run's context is created;
:class:`spader_pipeline.hooks.CompareCellsHooks` keeps that context's cells, and the registry
(:func:`spader_pipeline.pipeline_registry.register_pipelines`) hands them to the factory, so
``kedro run --env <env>`` builds the cells of ``<env>``; the hook stops a run whose registry was
built from other parameters (:func:`check_registered_cells`). Outside a run (``kedro registry list``,
``kedro viz``) the cells are read from conf (:func:`registered_cells`). One cell runs alone with
``kedro run --env compare --pipeline compare --namespaces grpo_seed0`` (docs/compare.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import partial, update_wrapper
from pathlib import Path
from typing import Any

from kedro.pipeline import Pipeline, node, pipeline

from spader_pipeline.pipelines.base_model import create_pipeline as base_model_pipeline
from spader_pipeline.pipelines.data_prep import create_pipeline as data_prep_pipeline
from spader_pipeline.pipelines.index_build import create_pipeline as index_build_pipeline
from spader_pipeline.pipelines.merge.nodes import merge_policy
from spader_pipeline.pipelines.training.nodes import train_policy
from spader_pipeline.pipelines.training.pipeline import warm_start_pipeline
from spader_pipeline.run_lock import CELL_TAG
from spader_pipeline.tracking import METHOD_RUN_TAG

from . import nodes

#: The environment whose ``compare`` block defines the cells outside a run when ``KEDRO_ENV`` is not set.
DESIGN_ENV = "compare"
#: Datasets every cell reads from outside its namespace (all persisted: a cell runs alone).
CELL_INPUTS = {"warm_start_manifest", "warm_start_validation", "verl_train", "verl_validation", "index_manifest",
               "compare_heldout"}
CELL_PARAMS = {"params:training", "params:merge", "params:evaluate", "params:prompt", "params:compare.output_dir",
               "params:compare.evaluation"}


def design_cells(compare: Mapping[str, Any] | None) -> list[tuple[str, int]]:
    """``compare.methods`` × ``compare.seeds`` as (method, seed) pairs, seed-major."""
    compare = compare or {}
    return [(str(m), int(s)) for s in compare.get("seeds") or [] for m in compare.get("methods") or []]


def registered_cells(project_path: Path | None = None, env: str | None = None) -> list[tuple[str, int]]:
    """The cells of a registry built outside a run: ``compare.methods`` × ``compare.seeds`` of ``env``
    (default: ``$KEDRO_ENV``, else ``compare``) read from conf with the project's config loader."""
    from kedro.framework.project import settings

    # A config loader registers its resolvers process-wide; a run never gets here (the registry
    # passes its cells to create_pipeline), so no running session's loader loses its own.
    conf = Path(project_path or Path.cwd()) / settings.CONF_SOURCE
    args = {**settings.CONFIG_LOADER_ARGS, "env": env or os.environ.get("KEDRO_ENV") or DESIGN_ENV}
    return design_cells(settings.CONFIG_LOADER_CLASS(conf_source=str(conf), **args)["parameters"].get("compare"))


def pipeline_cells(compare_pipeline: Pipeline) -> list[str]:
    """The cell names a registered ``compare`` pipeline holds."""
    return sorted({n.namespace.split(".")[0] for n in compare_pipeline.nodes if CELL_TAG in n.tags and n.namespace})


def check_registered_cells(compare_pipeline: Pipeline, env: str, compare: Mapping[str, Any] | None) -> None:
    """Stop a run whose registered cells are not its own ``compare.methods`` × ``compare.seeds``
    (a registry built earlier in this process from another environment's or run's parameters)."""
    registered = pipeline_cells(compare_pipeline)
    wanted = sorted(nodes.cell_name(m, s) for m, s in design_cells(compare))
    if registered == wanted:
        return
    compare = compare or {}
    raise ValueError(
        f"this run (env {env!r}) sets compare.methods × compare.seeds = {list(compare.get('methods') or [])} × "
        f"{list(compare.get('seeds') or [])}, cells {wanted}, but the registered compare pipeline has the cells "
        f"{registered}: the pipeline registry was loaded earlier in this process from other parameters. Set the "
        f"cells in conf/{env}/parameters_compare.yml (compare.methods, compare.seeds) and start the run in a new "
        f"process (kedro run --env {env} --pipeline compare), or bootstrap the project again "
        "(bootstrap_project, %reload_kedro) before creating its session.")


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
        tags=["compare", CELL_TAG],
    )
    return pipeline(template, namespace=name, inputs=CELL_INPUTS,
                    parameters={**{p: p for p in CELL_PARAMS}, "params:method": f"params:train_{method}.method"},
                    outputs={"training_history": f"{name}__history", "eval_samples": f"{name}__samples"})


def create_pipeline(cells: Sequence[tuple[str, int]] | None = None, **kwargs) -> Pipeline:
    """``cells``: (method, seed) pairs, those of the run's parameters (the registry passes them);
    ``None``: read from conf (:func:`registered_cells`)."""
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
