"""One ``merge_policy`` node per method: ``train_<method>.policy_manifest`` (the training's output)
→ ``<method>_model_manifest``, the Hugging Face folder evaluation reads (VERL FSDP checkpoints are
merged, native ones passed through)."""

from collections.abc import Sequence

from kedro.pipeline import Pipeline, node, pipeline

from spader_pipeline.algorithms.methods import default_methods

from .nodes import merge_policy


def model_manifest(method: str) -> str:
    """The catalog dataset of a trained method's Hugging Face model manifest."""
    return f"{method}_model_manifest"


def create_pipeline(methods: Sequence[str] | None = None, **kwargs) -> Pipeline:
    base = Pipeline([node(merge_policy, ["policy_manifest", "params:merge"], "model_manifest", name="merge_policy")],
                    tags="merge")
    out = Pipeline([])
    for method in methods or default_methods():
        out += pipeline(base, namespace=f"train_{method}", parameters={"params:merge"},
                        outputs={"model_manifest": model_manifest(method)})
    return out
