"""Pipeline registry: every package under ``pipelines/`` is discovered automatically."""

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline

# The default `kedro run` chain on the embedded default. The order comes from the datasets (e.g.
# evaluate reads the model manifests that training and merge write); a pipeline named here that
# does not exist (yet) is simply left out.
DEFAULT_CHAIN = ("data_prep", "index_build", "base_model", "training", "merge", "evaluate", "report")


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = find_pipelines(raise_errors=True)
    pipelines["__default__"] = sum((pipelines[name] for name in DEFAULT_CHAIN if name in pipelines), Pipeline([]))
    return pipelines
