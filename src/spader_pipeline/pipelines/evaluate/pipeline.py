from collections.abc import Sequence

from kedro.pipeline import Pipeline, node, pipeline

from . import nodes


def create_pipeline(after: Sequence[str] = (), **kwargs) -> Pipeline:
    """The evaluate pipeline. ``after``: datasets that must exist before models are evaluated (the
    default run passes the trained checkpoints' manifests, so evaluation waits for training)."""
    return pipeline(
        [
            node(
                nodes.select_eval_sets,
                ["eval_sets", "params:evaluate"],
                "eval_selected",
                name="select_eval_sets",
            ),
            node(
                nodes.count_entity_frequencies,
                ["eval_selected", "corpus", "params:evaluate"],
                "eval_entity_frequencies",
                name="count_entity_frequencies",
            ),
            node(
                nodes.run_evaluations_after if after else nodes.run_evaluations,
                [
                    "eval_selected",
                    "eval_entity_frequencies",
                    "index_manifest",
                    "params:evaluate",
                    "params:prompt",
                    *after,
                ],
                ["eval_samples", "eval_table", "evaluation_metrics"],
                name="run_evaluations",
            ),
            node(nodes.plot_comparison, "eval_table", "eval_comparison_plot", name="plot_eval_comparison"),
        ],
        tags="evaluate",
    )
