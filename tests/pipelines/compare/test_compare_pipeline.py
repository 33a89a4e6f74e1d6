"""`make compare` as Kedro pipelines: the design check, the cells registered from conf, and real
KedroSession runs (tiny model, test env): one stopped after its first cell and resumed by
``--only-missing-outputs``, then two cells again side by side on ParallelRunner from the same shared part."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from kedro.framework.hooks import hook_impl
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from kedro.runner import ParallelRunner

from spader_pipeline.pipelines.compare.nodes import cell_settings, check_design, seed_training
from spader_pipeline.pipelines.compare.pipeline import create_pipeline, registered_cells
from spader_pipeline.training import TrainingSettings

PARAMS = {"methods": ["grpo", "spader"], "seeds": [0, 1], "dataset": "embedded_test", "min_questions": 4}
CELLS = ["grpo_seed0", "spader_seed0", "grpo_seed1", "spader_seed1"]


def _sets(n: int) -> dict:
    frame = pd.DataFrame({"id": [str(i) for i in range(n)], "question": ["q"] * n})
    return {"embedded_test": lambda: frame}


def test_design_needs_two_seeds_two_methods_enough_questions_and_the_registered_cells():
    assert check_design(_sets(5), PARAMS)["question_ids"] == ["0", "1", "2", "3", "4"]
    with pytest.raises(ValueError, match="at least 2 seeds"):
        check_design(_sets(5), {**PARAMS, "seeds": [0, 0]})
    with pytest.raises(ValueError, match="two different methods"):
        check_design(_sets(5), {**PARAMS, "methods": ["grpo"]})
    with pytest.raises(ValueError, match="has 3 questions"):
        check_design(_sets(3), PARAMS)
    with pytest.raises(ValueError, match="not an evaluation set"):
        check_design(_sets(5), {**PARAMS, "dataset": "nope"})
    cells = (("grpo", 0), ("spader", 0), ("grpo", 1), ("spader", 1))
    assert check_design(_sets(5), PARAMS, cells)["seeds"] == [0, 1]
    with pytest.raises(ValueError, match="differ from the pipeline's cells"):
        check_design(_sets(5), {**PARAMS, "seeds": [0, 1, 2]}, cells)


def test_each_cell_gets_its_own_seed_directories_and_run_label():
    training = {"native": {"seed": 0, "total_steps": 3}, "verl": {"overrides": ["a=1"]}, "output_dir": "x"}
    shared = TrainingSettings.from_mapping(training)
    seeded = seed_training(shared, "out/compare", 2)
    assert seeded.output_dir == "out/compare/seed2" and seeded.native == {"seed": 2, "total_steps": 3}
    assert seeded.trainer.seed == 2 and seeded.seed == 2
    assert list(seeded.verl.overrides) == ["a=1", "data.seed=2", "actor_rollout_ref.actor.data_loader_seed=2"]
    assert shared.native["seed"] == 0 and training["native"]["seed"] == 0  # the shared settings are not modified
    cell, merge = cell_settings(training, {"timeout": 5}, "out/compare", 1)
    assert cell.run_label == "compare" and cell.seed == 1
    assert merge == {"timeout": 5, "output_dir": "out/compare/seed1/merged"}


def test_cells_come_from_conf_at_registry_time(project_root, tmp_path):
    shutil.copytree(project_root / "conf", tmp_path / "conf", ignore=shutil.ignore_patterns("local"))
    (tmp_path / "conf" / "local").mkdir()
    bootstrap_project(project_root)
    assert registered_cells(tmp_path, "compare") == [(m, s) for s in (0, 1, 2) for m in ("grpo", "spader")]
    (tmp_path / "conf/local/parameters_compare.yml").write_text("compare:\n  seeds: [0, 1, 2, 3, 4]\n")
    cells = registered_cells(tmp_path, "local")
    assert len(cells) == 10 and ("spader", 4) in cells
    pipeline = create_pipeline(cells)
    assert {"grpo_seed4", "spader_seed4"} <= {n.namespace for n in pipeline.nodes}
    one = pipeline.only_nodes_with_namespaces(["spader_seed4"])  # what --namespaces spader_seed4 runs
    assert [n.name.split(".")[1] for n in one.nodes] == ["cell_settings", "train_policy", "merge_policy",
                                                        "evaluate_cell"]
    # a cell reads only persisted shared datasets and its own parameters
    assert {i for i in one.inputs() if not i.startswith("params:")} == {
        "warm_start_manifest", "warm_start_validation", "verl_train", "verl_validation", "index_manifest",
        "compare_heldout"}
    assert "params:train_spader.method" in one.inputs() and "parameters" not in pipeline.inputs()


RUNTIME = {"compare": {"max_questions": 4}, "training": {"native": {"total_steps": 1}}}


class _StopAfter:
    """Fails the run right after one dataset is saved (a crash between two cells)."""

    def __init__(self, dataset_name: str) -> None:
        self.dataset_name = dataset_name

    @hook_impl
    def after_dataset_saved(self, dataset_name: str) -> None:
        if dataset_name == self.dataset_name:
            raise RuntimeError(f"stopped after {dataset_name}")


def _project(root: Path, project_root: Path, monkeypatch) -> Path:
    """A throw-away project whose test env registers the cells grpo/spader × seeds 0, 1."""
    root.mkdir()
    shutil.copy(project_root / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(project_root / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    (root / "src").mkdir()
    (root / "src" / "spader_pipeline").symlink_to(project_root / "src" / "spader_pipeline")
    with (root / "conf/test/parameters_compare.yml").open("a") as f:
        f.write("  seeds: [0, 1]\n")  # the runs' env (--env test) decides the cells
    monkeypatch.chdir(root)
    bootstrap_project(root)
    return root


def _run(root: Path, *hooks, **kwargs) -> None:
    with KedroSession.create(project_path=root, env="test", runtime_params=RUNTIME) as session:
        for hook in hooks:
            session._hook_manager.register(hook)
        session.run(pipeline_names=["compare"], **kwargs)


def _records(root: Path) -> pd.DataFrame:
    frame = pd.read_json(root / "data/07_model_output/compare_eval_samples.jsonl", lines=True, dtype={"id": str})
    return frame.sort_values(["model", "id"]).reset_index(drop=True).astype(str)


@pytest.mark.heavy
@pytest.mark.e2e
@pytest.mark.slow
def test_compare_resumes_after_its_first_cell_and_runs_in_parallel(project_root, tmp_path, monkeypatch, node_starts):
    """One run stopped right after its first cell and resumed by Kedro (sequential), then two cells
    again side by side on ParallelRunner from the same shared part; same records, same report."""
    since = f"attributes.start_time >= {int(time.time() * 1000)}"  # this test's MLflow runs only
    # 1. stopped right after the first cell's records are saved, then resumed
    resumed = _project(tmp_path / "resumed", project_root, monkeypatch)
    with pytest.raises(RuntimeError, match="stopped after"):
        _run(resumed, _StopAfter("grpo_seed0__samples"))
    weights = next((resumed / "data/06_models/compare/seed0/train_grpo/final").glob("*.safetensors"))
    before = weights.stat().st_mtime_ns
    _run(resumed, node_starts, only_missing_outputs=True)
    assert not [n for n in node_starts.names if n.startswith("grpo_seed0.") or n in ("warm_start", "validate_warm_start", "check_compare_design")]
    assert {"spader_seed1.evaluate_cell", "gather_cells", "compare_report"} <= set(node_starts.names)
    assert weights.stat().st_mtime_ns == before  # the first cell was not trained again

    runs = json.loads((resumed / "data/07_model_output/compare_runs.json").read_text())
    assert sorted(runs) == sorted(CELLS) and all([h["step"] for h in r["history"] if h["step"] > 0] == [1]
                                                 for r in runs.values())
    for cell in CELLS:  # each cell wrote its own per-question records
        assert len(pd.read_json(resumed / f"data/07_model_output/{cell}/eval_samples.jsonl", lines=True)) == 4
    samples = _records(resumed)
    assert set(samples["model"]) == {"warm_start", "scripted", *CELLS}
    report = (resumed / "data/08_reporting/compare_report.md").read_text()
    assert "SPADER vs GRPO" in report and "(paired)" in report and "detectable" in report
    metrics = json.loads((resumed / "data/08_reporting/compare_metrics.json").read_text())
    assert {"grpo/recall/mean", "spader/f1/low", "diff/recall/high"} <= set(metrics)
    # MLflow: one run per cell, named and tagged compare, with the cell's held-out scores
    cells = mlflow.search_runs(search_all_experiments=True, output_format="list",
                               filter_string=f"tags.chain_kind = 'compare' and {since}")
    assert sorted(r.info.run_name for r in cells) == sorted(f"compare {c.replace('_seed', ' seed')}" for c in CELLS)
    assert all("heldout/embedded_test/recall" in r.data.metrics for r in cells)
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list",
                                  filter_string=f"attributes.run_name LIKE 'evaluate:%' and {since}")
    (chain,) = mlflow.search_runs(search_all_experiments=True, output_format="list",  # the rerun's chain run
                                  filter_string=f"tags.`kedro.pipeline` = 'compare' and attributes.status = 'FINISHED' and {since}")
    assert "compare/diff/recall/mean" in chain.data.metrics

    # 2. seed 1's two cells again, side by side on ParallelRunner, from the first run's data (copied;
    # their outputs, the gathered records and the report removed): the cells are independent, so the
    # records and the report are the same (workers spawned: this process already runs torch's thread
    # pools, which a fork would inherit)
    monkeypatch.setenv("KEDRO_MP_CONTEXT", "spawn")
    parallel = _project(tmp_path / "parallel", project_root, monkeypatch)
    shutil.copytree(resumed / "data", parallel / "data")
    data = parallel / "data"
    again = ["grpo_seed1", "spader_seed1"]
    cell_outputs = [data / "06_models/compare/seed1", *(data / "07_model_output/compare_eval_work").glob("*_seed1*"),
                    data / "07_model_output/compare_runs.json", data / "07_model_output/compare_eval_samples.jsonl",
                    *(data / folder / cell for cell in again for folder in ("06_models", "07_model_output", "08_reporting")),
                    *(data / "08_reporting").glob("compare_*")]
    for path in cell_outputs:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    kept = {path: path.stat().st_mtime_ns for path in (data / "06_models/compare/seed0").rglob("*.safetensors")}
    _run(parallel, runner=ParallelRunner(max_workers=2), only_missing_outputs=True)
    assert kept and all(path.stat().st_mtime_ns == t for path, t in kept.items())  # seed 0's cells: not run
    for cell in again:  # trained and evaluated again, not copied
        assert (data / f"07_model_output/{cell}/eval_samples.jsonl").is_file()
        assert next((data / f"06_models/compare/seed1/train_{cell.split('_')[0]}/final").glob("*.safetensors"))
    pd.testing.assert_frame_equal(_records(parallel), samples)
    assert (parallel / "data/08_reporting/compare_report.md").read_text() == report


@pytest.mark.e2e
def test_a_held_out_set_too_small_stops_before_training(kedro_project):
    runtime = {**RUNTIME, "compare": {"min_questions": 100_000}}
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=runtime) as session:
        with pytest.raises(ValueError, match="a paired interval needs at least 100000"):
            session.run(pipeline_names=["compare"])
    assert not (kedro_project / "data/06_models/warm_start").exists()
