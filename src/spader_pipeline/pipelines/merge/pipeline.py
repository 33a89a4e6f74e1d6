"""One ``merge_policy`` node per method, namespaced like the training pipelines (``train_<method>``),
so ``train_spader.policy_manifest`` → ``train_spader.merged_manifest``."""

from kedro.pipeline import Pipeline, node, pipeline

from .nodes import merge_policy

METHODS = ("grpo", "spader")


def create_pipeline(**kwargs) -> Pipeline:
    base = Pipeline([node(merge_policy, ["policy_manifest", "params:merge"], "merged_manifest", name="merge_policy")],
                    tags="merge")
    out = Pipeline([])
    for method in kwargs.get("methods", METHODS):
        out += pipeline(base, namespace=f"train_{method}", parameters={"params:merge"})
    return out
