"""The ``compare`` pipeline: data, index and base model as in the default chain, then the design
check, the shared warm start, every method × seed trained and evaluated, and the report."""

from kedro.pipeline import Pipeline, node

from spader_pipeline.pipelines.base_model import create_pipeline as base_model_pipeline
from spader_pipeline.pipelines.data_prep import create_pipeline as data_prep_pipeline
from spader_pipeline.pipelines.index_build import create_pipeline as index_build_pipeline

from . import nodes


def create_pipeline(**kwargs) -> Pipeline:
    comparison = Pipeline(
        [
            node(nodes.check_design, ["eval_sets", "params:compare"], "compare_design", name="check_compare_design"),
            node(
                nodes.shared_warm_start,
                ["compare_design", "base_model_manifest", "verl_train", "verl_validation", "index_manifest",
                 "params:warm_start", "params:prompt"],
                ["warm_start_manifest", "warm_start_metrics"],
                name="warm_start",
            ),
            node(
                nodes.train_and_evaluate,
                ["compare_design", "warm_start_manifest", "verl_train", "index_manifest", "eval_sets", "corpus",
                 "parameters", "verl_validation"],
                ["compare_runs", "compare_eval_samples"],
                name="train_and_evaluate",
            ),
            node(
                nodes.write_report,
                ["compare_design", "compare_runs", "compare_eval_samples", "params:compare", "params:training"],
                ["compare_report", "compare_curves", "compare_metrics"],
                name="compare_report",
            ),
        ],
        tags="compare",
    )
    return data_prep_pipeline() + index_build_pipeline() + base_model_pipeline() + comparison
