from kedro.pipeline import Pipeline, node, pipeline

from . import nodes


def create_pipeline(**kwargs) -> Pipeline:
    return pipeline(
        [
            node(nodes.build_retrieval_index, ["corpus", "params:index_build"], "index_manifest",
                 name="build_retrieval_index"),
            node(nodes.measure_index, ["index_manifest", "params:index_build"], "index_build_metrics",
                 name="measure_index"),
        ],
        tags="index_build",
    )
