"""Pipeline registry: every package under ``pipelines/`` is discovered automatically, and every
registered RL method gets its own ``train_<method>`` pipeline (the modular training pipeline under
the method's namespace; its settings are the ``train_<method>`` block of parameters_training.yml).

The default chain is also registered in the two parts around its methods' training runs
(:func:`around_methods`), so that a launcher can train the methods side by side as separate jobs:
``make run`` runs ``default_before_methods``, then ``--nodes train_<method>.train_policy`` for each
method at once, then ``default_after_methods``; together exactly the nodes of ``__default__``.
"""

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from kedro.pipeline import Pipeline

from spader_pipeline import pipelines as pipeline_packages
from spader_pipeline.algorithms.methods import method_names
from spader_pipeline.hooks import CompareCellsHooks
from spader_pipeline.pipelines.training import method_pipeline
from spader_pipeline.tracking import METHOD_RUN_TAG

# The default `kedro run` chain on the embedded default. The order comes from the datasets (e.g.
# evaluate reads the model manifests that training and merge write); a pipeline named here that
# does not exist (yet) is simply left out.
DEFAULT_CHAIN = ("data_prep", "index_build", "base_model", "training", "merge", "evaluate", "report")


def package_pipelines(arguments: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Pipeline]:
    """``create_pipeline(**arguments[name])`` of every package ``name`` under ``pipelines/``, always all
    of them (an import error raises). Kedro's ``find_pipelines`` imports only the packages named on
    the command line (``kedro run --pipeline X``, ``kedro registry describe X``) and raises for a name
    without a package, which every ``train_<method>`` pipeline is."""
    arguments = arguments or {}
    return {
        info.name: importlib.import_module(f"{pipeline_packages.__name__}.{info.name}").create_pipeline(
            **arguments.get(info.name, {}))
        for info in pkgutil.iter_modules(pipeline_packages.__path__)
        if info.ispkg
    }


def run_compare_cells() -> list[tuple[str, int]] | None:
    """The compare cells of the run whose context was created last (``None`` outside a run: the
    compare pipeline then reads them from conf), as :class:`~spader_pipeline.hooks.CompareCellsHooks`
    kept them."""
    from kedro.framework.project import settings

    for hook in settings.HOOKS:
        if isinstance(hook, CompareCellsHooks):
            return hook.run_cells
    return None


def around_methods(chain: Pipeline) -> tuple[Pipeline, Pipeline]:
    """``chain`` less its method training nodes (tagged :data:`~spader_pipeline.tracking.METHOD_RUN_TAG`),
    split in two: what any of them needs (data, index, warm start, its validation), and the rest
    (merges, evaluation, report, and nodes no training needs)."""
    methods = Pipeline([n for n in chain.nodes if METHOD_RUN_TAG in n.tags])
    if not methods.nodes:
        return chain, Pipeline([])
    before = chain.to_nodes(*(n.name for n in methods.nodes)) - methods
    return before, chain - before - methods


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = package_pipelines({"compare": {"cells": run_compare_cells()}})
    for method in method_names():
        pipelines.setdefault(f"train_{method}", method_pipeline(method))
    pipelines["__default__"] = sum((pipelines[name] for name in DEFAULT_CHAIN if name in pipelines), Pipeline([]))
    pipelines["default_before_methods"], pipelines["default_after_methods"] = around_methods(pipelines["__default__"])
    return pipelines
