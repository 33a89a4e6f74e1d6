"""The ``positive_control`` pipeline: data, index, base model and the shared warm start as in
``compare``, the fitted set and the warm start's step-0 score on it, then one namespace per method ×
seed (:data:`CELLS`: GRPO and SPADER, seeds 0 and 1) training on the fitted questions, then the report.

The cells are fixed here, not read from parameters: the positive control is one design (2 methods × 2
seeds, docs/results.md), so the registry never depends on the run's environment. A cell runs alone
with ``--namespaces fit_grpo_seed0``; ``--only-missing-outputs`` resumes.
"""

from __future__ import annotations

from functools import partial, update_wrapper

from kedro.pipeline import Pipeline, node, pipeline

from spader_pipeline.pipelines.base_model import create_pipeline as base_model_pipeline
from spader_pipeline.pipelines.data_prep import create_pipeline as data_prep_pipeline
from spader_pipeline.pipelines.index_build import create_pipeline as index_build_pipeline
from spader_pipeline.pipelines.training.nodes import train_policy, validate_warm_start
from spader_pipeline.pipelines.training.pipeline import warm_start_pipeline
from spader_pipeline.run_lock import CELL_TAG
from spader_pipeline.tracking import METHOD_RUN_TAG

from . import nodes

#: (method, seed) of every cell, seed-major
CELLS = [(method, seed) for seed in (0, 1) for method in ("grpo", "spader")]
CELL_INPUTS = {"warm_start_manifest", "fitted_train", "fitted_validation", "fitted_start_validation",
               "index_manifest"}
CELL_PARAMS = {"params:training", "params:prompt", "params:positive_control.output_dir"}


def cell_pipeline(method: str, seed: int) -> Pipeline:
    """One method × seed under the namespace :func:`nodes.cell_name`; its per-step history is
    ``<cell>__history``."""
    name = nodes.cell_name(method, seed)
    template = Pipeline(
        [
            node(update_wrapper(partial(nodes.cell_settings, seed=seed), nodes.cell_settings),
                 ["params:training", "params:positive_control.output_dir"], "training_settings",
                 name="cell_settings"),
            node(train_policy,
                 ["warm_start_manifest", "fitted_train", "index_manifest", "params:method", "training_settings",
                  "params:prompt", "fitted_validation", "fitted_start_validation"],
                 ["policy_manifest", "training_history", "training_metrics"],
                 name="train_policy", tags=[METHOD_RUN_TAG]),
        ],
        tags=["positive_control", CELL_TAG],
    )
    return pipeline(template, namespace=name, inputs=CELL_INPUTS,
                    parameters={**{p: p for p in CELL_PARAMS}, "params:method": f"params:train_{method}.method"},
                    outputs={"training_history": f"{name}__history"})


def create_pipeline(**kwargs) -> Pipeline:
    shared = Pipeline(
        [
            node(nodes.fitted_set, ["verl_train", "verl_validation", "params:positive_control"],
                 ["fitted_train", "fitted_validation"], name="fitted_set"),
            node(nodes.start_validation_settings, "params:training", "fitted_start_settings",
                 name="fitted_start_settings"),
            node(validate_warm_start,
                 ["warm_start_manifest", "fitted_validation", "index_manifest", "fitted_start_settings",
                  "params:prompt"], "fitted_start_validation", name="validate_warm_start_on_fitted_set"),
        ],
        tags="positive_control",
    )
    histories = {f"{nodes.cell_name(m, s)}__history": f"{nodes.cell_name(m, s)}__history" for m, s in CELLS}
    report = Pipeline(
        [node(nodes.write_report, {"design": "params:positive_control", "training": "params:training", **histories},
              ["positive_control_report", "positive_control_curves", "positive_control_metrics"],
              name="positive_control_report")],
        tags="positive_control",
    )
    cells = sum((cell_pipeline(m, s) for m, s in CELLS), Pipeline([]))
    warm = warm_start_pipeline().only_nodes("warm_start")  # its step 0 is on the fitted set (above)
    return data_prep_pipeline() + index_build_pipeline() + base_model_pipeline() + warm + shared + cells + report
