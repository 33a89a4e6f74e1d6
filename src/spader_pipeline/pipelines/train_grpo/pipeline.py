from kedro.pipeline import Pipeline

from spader_pipeline.pipelines.training.pipeline import method_pipeline


def create_pipeline(**kwargs) -> Pipeline:
    return method_pipeline("grpo")
