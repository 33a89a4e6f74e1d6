from kedro.pipeline import Pipeline

from spader_pipeline.pipelines.training.pipeline import warm_start_pipeline


def create_pipeline(**kwargs) -> Pipeline:
    return warm_start_pipeline()
