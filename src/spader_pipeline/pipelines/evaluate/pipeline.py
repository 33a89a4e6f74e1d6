"""The evaluate pipeline: the configured datasets × the models of the catalog and ``evaluate.models``.

The trained models come from the catalog: ``run_evaluations`` takes the manifests of the base
model, the warm start and each trained method (``<method>_model_manifest``, written by the merge
pipeline: a VERL checkpoint merged to a Hugging Face folder, a native one passed through). Being
inputs, they also order evaluation after training in the default run — no special case needed.
"""

from collections.abc import Mapping, Sequence

from kedro.pipeline import Pipeline, node

from spader_pipeline.algorithms.methods import default_methods
from spader_pipeline.pipelines.merge.pipeline import model_manifest

from . import nodes


def model_manifests(methods: Sequence[str] | None = None) -> dict[str, str]:
    """Evaluated model name → catalog manifest dataset (default methods: the registry's default run)."""
    return {"base": "base_model_manifest", "warm_start": "warm_start_manifest",
            **{method: model_manifest(method) for method in methods or default_methods()}}


def create_pipeline(models: Mapping[str, str] | None = None, **kwargs) -> Pipeline:
    """``models``: model name → manifest dataset (default: :func:`model_manifests`)."""
    models = model_manifests() if models is None else dict(models)
    return Pipeline(
        [
            node(nodes.select_eval_sets, ["eval_sets", "params:evaluate"], "eval_selected", name="select_eval_sets"),
            node(
                nodes.count_entity_frequencies,
                ["eval_selected", "corpus", "params:evaluate"],
                "eval_entity_frequencies",
                name="count_entity_frequencies",
            ),
            node(
                nodes.run_evaluations,
                {"selected": "eval_selected", "frequencies": "eval_entity_frequencies",
                 "index_manifest": "index_manifest", "params": "params:evaluate", "prompt": "params:prompt",
                 **models},
                ["eval_samples", "eval_table", "evaluation_metrics"],
                name="run_evaluations",
            ),
            node(nodes.plot_comparison, "eval_table", "eval_comparison_plot", name="plot_eval_comparison"),
        ],
        tags="evaluate",
    )
