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

from kedro.pipeline import Pipeline

from spader_pipeline import pipelines as pipeline_packages
from spader_pipeline.algorithms.methods import method_names
from spader_pipeline.pipelines.training import method_pipeline
from spader_pipeline.tracking import METHOD_RUN_TAG

# The default `kedro run` chain on the embedded default. The order comes from the datasets (e.g.
# evaluate reads the model manifests that training and merge write); a pipeline named here that
# does not exist (yet) is simply left out.
DEFAULT_CHAIN = ("data_prep", "index_build", "base_model", "training", "merge", "evaluate", "report")


def package_pipelines() -> dict[str, Pipeline]:
    """``create_pipeline()`` of every package under ``pipelines/``, always all of them (an import
    error raises). Kedro's ``find_pipelines`` imports only the packages named on the command line
    (``kedro run --pipeline X``, ``kedro registry describe X``) and raises for a name without a
    package, which every ``train_<method>`` pipeline is."""
    return {
        info.name: importlib.import_module(f"{pipeline_packages.__name__}.{info.name}").create_pipeline()
        for info in pkgutil.iter_modules(pipeline_packages.__path__)
        if info.ispkg
    }


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
    pipelines = package_pipelines()
    for method in method_names():
        pipelines.setdefault(f"train_{method}", method_pipeline(method))
    pipelines["__default__"] = sum((pipelines[name] for name in DEFAULT_CHAIN if name in pipelines), Pipeline([]))
    pipelines["default_before_methods"], pipelines["default_after_methods"] = around_methods(pipelines["__default__"])
    return pipelines
