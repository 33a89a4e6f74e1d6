from kedro.pipeline import Pipeline, node

from .nodes import build_report

METHODS = ("grpo", "spader")


def create_pipeline(**kwargs) -> Pipeline:
    methods = kwargs.get("methods", METHODS)
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
