"""Pipeline registry: every package under ``pipelines/`` is discovered automatically, and every
registered RL method gets its own ``train_<method>`` pipeline (the modular training pipeline under
the method's namespace; its settings are the ``train_<method>`` block of parameters_training.yml)."""

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline

from spader_pipeline.algorithms.methods import method_names
from spader_pipeline.pipelines.training import method_pipeline

# The default `kedro run` chain on the embedded default. The order comes from the datasets (e.g.
# evaluate reads the model manifests that training and merge write); a pipeline named here that
# does not exist (yet) is simply left out.
DEFAULT_CHAIN = ("data_prep", "index_build", "base_model", "training", "merge", "evaluate", "report")


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = find_pipelines(raise_errors=True)
    for method in method_names():
        pipelines.setdefault(f"train_{method}", method_pipeline(method))
    pipelines["__default__"] = sum((pipelines[name] for name in DEFAULT_CHAIN if name in pipelines), Pipeline([]))
    return pipelines
