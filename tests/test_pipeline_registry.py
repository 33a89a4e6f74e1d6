"""The registry: every default-chain pipeline exists, and evaluation takes its models from the catalog."""

from kedro.framework.startup import bootstrap_project

from spader_pipeline.pipeline_registry import DEFAULT_CHAIN


def test_default_run_evaluates_the_trained_models_of_the_catalog(project_root):
    bootstrap_project(project_root)
    from spader_pipeline.pipeline_registry import register_pipelines

    pipelines = register_pipelines()
    assert set(DEFAULT_CHAIN) <= set(pipelines)
    from spader_pipeline.algorithms.methods import method_names

    assert {f"train_{m}" for m in method_names()} <= set(pipelines)  # one per registered method
    default = pipelines["__default__"]
    (evaluate,) = [n for n in default.nodes if n.name == "run_evaluations"]
    # the trained models are inputs: the merged/passed-through manifest of each method, not paths
    assert {"base_model_manifest", "warm_start_manifest", "grpo_model_manifest", "spader_model_manifest"} <= set(evaluate.inputs)
    order = [n.name for n in default.nodes]  # topologically sorted
    assert order.index("train_spader.train_policy") < order.index("train_spader.merge_policy") < order.index("run_evaluations")
    assert order.index("run_evaluations") < order.index("build_report")
    # run alone, evaluate reads the same manifests (from disk), the same way
    (alone,) = [n for n in pipelines["evaluate"].nodes if n.name == "run_evaluations"]
    assert set(alone.inputs) == set(evaluate.inputs)


def test_evaluation_and_merge_use_no_dotted_names_outside_their_namespace(project_root):
    """Dots are Kedro's namespace notation: a node reads another namespace's dataset only through a
    plain name (``grpo_model_manifest``), never ``train_grpo.…``."""
    bootstrap_project(project_root)
    from spader_pipeline.pipeline_registry import register_pipelines

    pipelines = register_pipelines()
    for name in ("training", "merge", "evaluate"):
        for node in pipelines[name].nodes:
            for dataset in [*node.inputs, *node.outputs]:
                if "." in dataset and not dataset.startswith("params:"):
                    assert node.namespace and dataset.startswith(node.namespace + "."), (node.name, dataset)


def test_a_train_method_pipeline_can_be_requested_by_name(project_root):
    """``kedro run --pipeline train_spader`` and ``kedro registry describe train_spader`` ask Kedro
    for that pipeline alone (``pipelines.set_requested``); it has no package of its own under
    pipelines/, and is still found, with the packages it is combined with."""
    bootstrap_project(project_root)
    from kedro.framework.project import pipelines

    try:
        pipelines.set_requested(["train_spader", "merge"])
        assert [n.name for n in pipelines["train_spader"].nodes] == ["train_spader.train_policy"]
        assert "train_spader.merge_policy" in {n.name for n in pipelines["merge"].nodes}
    finally:
        pipelines.set_requested(None)
