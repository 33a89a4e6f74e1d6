"""The registry: every default-chain pipeline exists and the default run evaluates after training."""

from kedro.framework.startup import bootstrap_project

from spader_pipeline.pipeline_registry import DEFAULT_CHAIN


def test_default_run_chains_every_stage_and_evaluates_trained_checkpoints(project_root):
    bootstrap_project(project_root)
    from spader_pipeline.pipeline_registry import register_pipelines

    pipelines = register_pipelines()
    assert set(DEFAULT_CHAIN) <= set(pipelines)
    default = pipelines["__default__"]
    (evaluate,) = [n for n in default.nodes if n.name == "run_evaluations"]
    assert {"warm_start_manifest", "train_grpo.policy_manifest", "train_spader.policy_manifest"} <= set(evaluate.inputs)
    order = [n.name for n in default.nodes]  # topologically sorted
    assert order.index("train_spader.train_policy") < order.index("run_evaluations") < order.index("build_report")
    # run alone, evaluate needs no training outputs
    (alone,) = [n for n in pipelines["evaluate"].nodes if n.name == "run_evaluations"]
    assert not any(name.endswith("manifest") and name != "index_manifest" for name in alone.inputs)
