from kedro.pipeline import Pipeline, node

from spader_pipeline.algorithms.methods import default_methods

from .nodes import build_report


def create_pipeline(**kwargs) -> Pipeline:
    methods = kwargs.get("methods") or default_methods()
    inputs = {"eval_table": "eval_table", "warm_start_metrics": "warm_start_metrics", "params": "params:report"}
    inputs.update({f"history_{m}": f"train_{m}.training_history" for m in methods})
    return Pipeline(
        [
            node(
                build_report,
                inputs=inputs,
                outputs=["report_training_curves", "report_final_comparison", "report_markdown", "report_metrics"],
                name="build_report",
            )
        ],
        tags="report",
    )
