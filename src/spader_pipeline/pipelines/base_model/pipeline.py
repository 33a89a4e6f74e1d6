from kedro.pipeline import Pipeline, node

from .nodes import provide_base_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                provide_base_model,
                inputs=["corpus", "params:base_model", "params:prompt"],
                outputs="base_model_manifest",
                name="provide_base_model",
            )
        ]
    )
