"""Pipeline registry: every package under ``pipelines/`` is discovered automatically."""

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline

# The default `kedro run` chain on the embedded default, in order. A pipeline named here
# that does not exist (yet) is simply left out.
DEFAULT_CHAIN = ("data_prep", "index_build", "base_model", "training", "evaluate", "report")


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = find_pipelines(raise_errors=True)
    default = Pipeline([])
    for name in DEFAULT_CHAIN:
        if name == "evaluate" and "training" in pipelines:
            # Nothing else orders evaluation after training: make it wait for the checkpoints.
            from spader_pipeline.pipelines.evaluate.pipeline import create_pipeline as evaluate_pipeline

            trained = sorted(d for d in pipelines["training"].all_outputs() if d.endswith("manifest"))
            default += evaluate_pipeline(after=trained)
        elif name in pipelines:
            default += pipelines[name]
    pipelines["__default__"] = default
    return pipelines
