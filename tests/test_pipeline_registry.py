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


def test_the_default_chain_splits_around_its_methods_into_jobs_that_meet_on_disk(project_root):
    """``make run``'s three phases: the part before the methods, each method's training node alone,
    the part after. Together they are the default chain, node for node; the part before needs no
    method's output, and every dataset one phase hands to a later one is saved (a separate
    ``kedro run`` reads it from disk, none is a MemoryDataset)."""
    bootstrap_project(project_root)
    from kedro.framework.session import KedroSession
    from kedro.io import MemoryDataset

    from spader_pipeline.algorithms.methods import default_methods
    from spader_pipeline.pipeline_registry import register_pipelines

    pipelines = register_pipelines()
    default, before, after = (pipelines[n] for n in ("__default__", "default_before_methods", "default_after_methods"))
    methods = {f"train_{m}.train_policy" for m in default_methods()}
    names = [n.name for n in before.nodes] + sorted(methods) + [n.name for n in after.nodes]
    assert sorted(names) == sorted(n.name for n in default.nodes)  # each node once
    assert {"warm_start", "validate_warm_start"} <= {n.name for n in before.nodes}
    assert {"run_evaluations", "build_report"} <= {n.name for n in after.nodes}
    method_nodes = [n for n in default.nodes if n.name in methods]
    method_inputs = {i for n in method_nodes for i in n.inputs}
    method_outputs = {o for n in method_nodes for o in n.outputs}
    assert not method_outputs & before.all_inputs()
    handed_on = (before.all_outputs() & (method_inputs | after.inputs())) | (method_outputs & after.inputs())
    assert {"warm_start_manifest", "train_grpo.policy_manifest"} <= handed_on
    with KedroSession.create(project_path=project_root) as session:
        catalog = session.load_context().catalog
        for dataset in sorted(handed_on):
            assert not isinstance(catalog.get(dataset), MemoryDataset | type(None)), dataset


def test_the_compare_cells_are_passed_to_the_pipeline_factory(project_root):
    """No module keeps a run's cells: the registry passes them to ``compare.create_pipeline``
    (those :class:`~spader_pipeline.hooks.CompareCellsHooks` kept from the run's context)."""
    bootstrap_project(project_root)
    import spader_pipeline.pipelines.compare.pipeline as compare
    from spader_pipeline.pipeline_registry import package_pipelines

    pipelines = package_pipelines({"compare": {"cells": [("grpo", 7), ("spader", 7)]}})
    assert compare.pipeline_cells(pipelines["compare"]) == ["grpo_seed7", "spader_seed7"]
    assert not [name for name in vars(compare) if name.startswith("_run")]
