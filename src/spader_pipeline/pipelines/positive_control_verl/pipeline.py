"""The ``positive_control_verl`` pipeline: ``positive_control``'s shared part and native cells, one
namespace per verl cell (:data:`VERL_CELLS`, ``fit_<method>_verl_seed<k>``) training on the same fitted
questions through verl's real loop, and one report over the cells of both trainers.

It runs in the positive control's environment and data root (``--env positive_control``), so after
``make positive-control`` only the verl cells and the report have work left (``--only-missing-outputs``:
the warm start, the fitted set and the native cells are stored); on a fresh root it runs the whole
positive control first. The native report (``positive_control_report``) is ``positive_control``'s alone.
"""

from __future__ import annotations

from functools import partial, update_wrapper

from kedro.pipeline import Pipeline, node, pipeline

from spader_pipeline.pipelines.positive_control import create_pipeline as positive_control_pipeline
from spader_pipeline.pipelines.positive_control.nodes import cell_name
from spader_pipeline.pipelines.positive_control.pipeline import CELLS
from spader_pipeline.pipelines.training.nodes import train_policy
from spader_pipeline.run_lock import CELL_TAG
from spader_pipeline.tracking import METHOD_RUN_TAG

from . import nodes

#: (method, seed) of every verl cell: the native cells' methods and seeds, so that each trainer's verdict reads
#: the same number of cells (its interval over cells has their degrees of freedom)
VERL_CELLS = list(CELLS)
#: the native pipeline's report node, left out here (this pipeline's report has every cell)
NATIVE_REPORT = "positive_control_report"


def verl_cell_pipeline(method: str, seed: int) -> Pipeline:
    """One verl cell under the namespace :func:`nodes.verl_cell_name`; its per-step history is
    ``<cell>__history``, under the native cells' metric names."""
    name = nodes.verl_cell_name(method, seed)
    template = Pipeline(
        [
            node(update_wrapper(partial(nodes.verl_cell_settings, seed=seed), nodes.verl_cell_settings),
                 ["params:training", "params:positive_control_verl"], "training_settings", name="cell_settings"),
            # no fitted_start_validation: verl validates the warm start itself, before its first step
            node(train_policy,
                 ["warm_start_manifest", "fitted_train", "index_manifest", "params:method", "training_settings",
                  "params:prompt", "fitted_validation"],
                 ["policy_manifest", "training_history", "training_metrics"],
                 name="train_policy", tags=[METHOD_RUN_TAG]),
        ],
        tags=["positive_control", "positive_control_verl", CELL_TAG],
    )
    return pipeline(template, namespace=name, inputs={"warm_start_manifest", "fitted_train", "fitted_validation",
                                                      "index_manifest"},
                    parameters={"params:training": "params:training", "params:prompt": "params:prompt",
                                "params:positive_control_verl": "params:positive_control_verl",
                                "params:method": f"params:train_{method}.method"},
                    outputs={"training_history": f"{name}__history"})


def trainers() -> dict[str, str]:
    """Every cell of the pipeline → its trainer (``native``, ``verl``), in the report's order."""
    return {**{cell_name(m, s): "native" for m, s in CELLS}, **{nodes.verl_cell_name(m, s): "verl" for m, s in VERL_CELLS}}


def create_pipeline(**kwargs) -> Pipeline:
    native = positive_control_pipeline()
    cells = sum((verl_cell_pipeline(m, s) for m, s in VERL_CELLS), Pipeline([]))
    histories = {f"{cell}__history": f"{cell}__history" for cell in trainers()}
    report = Pipeline(
        [node(update_wrapper(partial(nodes.write_report, trainers=trainers()), nodes.write_report),
              {"design": "params:positive_control", **histories},
              ["positive_control_verl_report", "positive_control_verl_curves", "positive_control_verl_metrics"],
              name="positive_control_verl_report")],
        tags=["positive_control", "positive_control_verl"],
    )
    return native - native.only_nodes(NATIVE_REPORT) + cells + report
