"""``make positive-control-verl``: the verl cells' settings (the native cells' design on verl), the
pipeline (the positive control's shared part and native cells, the verl cells, one report), and the
report of both trainers in one table under the same metric names, through a real KedroSession. The
verl cells' training through verl's own loop is tests/verl_plugin/test_verl_positive_control.py
(``make test-verl``)."""

from __future__ import annotations

import json

import mlflow
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline.grid.phases import split
from spader_pipeline.launch.overrides import build_overrides
from spader_pipeline.pipelines.positive_control.nodes import cell_name, cell_settings
from spader_pipeline.pipelines.positive_control.pipeline import CELLS
from spader_pipeline.pipelines.positive_control_verl import create_pipeline
from spader_pipeline.pipelines.positive_control_verl.nodes import (
    verl_cell_name,
    verl_cell_settings,
    write_report,
)
from spader_pipeline.pipelines.positive_control_verl.pipeline import VERL_CELLS, trainers

DESIGN = {"questions": 4, "validation_questions": 2, "target_gain": 0.2}
TRAINING = {"validation": {"every": 5, "before_train": True, "max_questions": 16, "batch_size": {"fitted": 1}},
            "native": {"prompts_per_step": 4, "group_size": 4, "total_steps": 5, "ppo_epochs": 1, "ppo_mini_batches": 4,
                       "temperature": 0.7, "max_new_tokens": 96, "max_prompt_tokens": 1024,
                       "rollout": {"max_turns": 6, "max_response_tokens": 1024, "topk": 3,
                                   "max_observation_chars": 1200, "max_document_chars": 120}},
            "verl": {"overrides": ["trainer.logger=[console]"]}}
VERL_CELLS_BLOCK = {"output_dir": "out/verl", "verl": {"platform": "cpu", "n_gpus_per_node": 1, "timeout": 60,
                                                      "search_tool": {"topk": 5},
                                                      "overrides": ["actor_rollout_ref.actor.optim.lr=1.0e-5"]}}


def _history(fitted: list[float], held: list[float], steps=(0, 5)) -> list[dict[str, float]]:
    return [{"step": s, "val/fitted/recall": f, "val/embedded/recall": v, "val/fitted/f1": f, "val/embedded/f1": v}
            for s, f, v in zip(steps, fitted, held, strict=True)]


def test_a_verl_cell_trains_the_native_cells_design_through_verl():
    settings = verl_cell_settings(TRAINING, VERL_CELLS_BLOCK, seed=1)
    native = cell_settings(TRAINING, "out", seed=1)
    assert settings.backend == "verl" and native.backend == "native"
    assert settings.output_dir == "out/verl/seed1" and settings.run_label == "positive control verl"
    # every validation row, in one batch (verl's), on the native cells' schedule
    assert settings.validation.max_questions is None and settings.validation.batch_size is None
    assert (settings.validation.every, settings.validation.before_train) == (5, True)
    assert (settings.verl.platform, settings.verl.n_gpus_per_node, settings.verl.timeout) == ("cpu", 1, 60)
    overrides = list(settings.verl.overrides)
    design = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=5",
              "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.actor.ppo_epochs=1",
              "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # 4 mini-batches of one question's group each
              "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=6", "data.max_response_length=1024",
              "++actor_rollout_ref.rollout.custom.max_turn_tokens=96"]
    assert set(design) <= set(overrides)
    # the design first, then training.verl's and the seed's, then the block's own (which may change any)
    order = [overrides.index(o) for o in ("data.train_batch_size=4", "trainer.logger=[console]", "data.seed=1",
                                          "actor_rollout_ref.rollout.seed=1", "actor_rollout_ref.actor.optim.lr=1.0e-5")]
    assert order == sorted(order)
    # the native rollout's search limits, the block's own over them
    assert settings.verl.search_tool == {"topk": 5, "max_chars": 10000, "max_observation_chars": 1200,
                                         "max_document_chars": 120, "max_queries_per_call": 16}
    # verl takes the command line (the one-method-key check included)
    launch = settings.with_method({"method": "spader", "reward": {"tool_round_cost": 0.01}}).verl_launch()
    argv = build_overrides({"method": "spader", "validation": launch.validation, "overrides": list(launch.verl.overrides)})
    assert "trainer.val_before_train=true" in argv and "trainer.test_freq=5" in argv


def test_the_pipeline_is_the_positive_control_with_verl_cells_and_one_report():
    grid = split(create_pipeline(), "positive_control_verl")
    assert sorted(grid.cells) == sorted([*(cell_name(m, s) for m, s in CELLS), *(verl_cell_name(m, s) for m, s in VERL_CELLS)])
    assert [n.name for n in grid.report.nodes] == ["positive_control_verl_report"]  # not the native report
    assert {"fitted_set", "validate_warm_start_on_fitted_set", "warm_start"} <= {n.name for n in grid.shared.nodes}
    verl_cell = grid.cells["fit_grpo_verl_seed0"]
    # the same fitted questions and validation rows as the native cells; step 0 is verl's own
    assert verl_cell.inputs() >= {"fitted_train", "fitted_validation", "warm_start_manifest"}
    assert "fitted_start_validation" not in verl_cell.inputs()
    assert grid.report.inputs() >= {f"{cell}__history" for cell in grid.cells}
    assert set(trainers().values()) == {"native", "verl"} and set(trainers()) == set(grid.cells)


def test_the_report_shows_both_trainers_cells_in_one_table_under_the_same_names():
    histories = {"fit_grpo_seed0__history": _history([0.3, 0.55], [0.1, 0.1]),
                 "fit_grpo_verl_seed0__history": _history([0.25, 0.3], [0.1, 0.12]),
                 "fit_spader_verl_seed0__history": _history([0.25, 0.5], [0.1, 0.1])}
    cells = {"fit_grpo_seed0": "native", "fit_grpo_verl_seed0": "verl", "fit_spader_verl_seed0": "verl"}
    text, figure, metrics = write_report(DESIGN, cells, **histories)
    table = [line for line in text.splitlines() if line.startswith("| fit_")]
    assert [line.split(" | ")[:2] for line in table] == [["| fit_grpo_seed0", "native"], ["| fit_grpo_verl_seed0", "verl"],
                                                         ["| fit_spader_verl_seed0", "verl"]]
    assert "| cell | trainer | steps |" in text and "- native: **not shown**: **1 of 1 cells** gained at least +0.20" in text
    assert "(embedded, greedy; verl cells: sampled as the fitted): warm start → last" in text  # verl samples them
    assert "- verl: **not shown**: **1 of 2 cells** gained at least +0.20 fitted recall; the mean gain over cells is **+0.150**" in text
    assert metrics["verl/cells_reached"] == 1 and metrics["native/mean_gain"] == pytest.approx(0.25)
    assert metrics["fit_spader_verl_seed0/gain"] == pytest.approx(0.25) and metrics["cells"] == 3
    assert len(figure.axes) == 2


def test_the_report_of_both_trainers_runs_through_a_kedro_session(kedro_project):
    data = kedro_project / "data"
    for k, cell in enumerate(trainers()):
        path = data / "07_model_output" / cell / "training_history.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_history([0.3, 0.45 + 0.05 * k], [0.1, 0.1])))
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["positive_control_verl"], node_names=["positive_control_verl_report"])
    report = (data / "08_reporting/positive_control_verl_report.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in report.splitlines() if line.startswith("| fit_")}
    assert rows == trainers()
    assert (data / "08_reporting/positive_control_verl_curves.png").stat().st_size > 0
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                filter_string=f"metrics.`positive_control_verl/verl/cells` = {len(VERL_CELLS)}")
    assert run.data.metrics["positive_control_verl/cells"] == len(trainers())



@pytest.mark.slow
@pytest.mark.verl_workers  # verl's CLI in a process of its own: make test-verl's tier
def test_a_verl_cells_launch_composes_with_verls_own_cli(tmp_path, monkeypatch):
    """verl's CLI (``main_ppo … --cfg job``) composes a verl cell's command as ``make positive-control-verl``
    launches it (conf/positive_control over conf/base): every override is one of verl's keys, and the
    config is the native cells' design on verl's CPU platform."""
    import subprocess
    from pathlib import Path

    import pandas as pd
    import yaml
    from kedro.config import OmegaConfigLoader

    from spader_pipeline.launch.command import build_launch

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    params = OmegaConfigLoader(str(root / "conf"), base_env="base", default_run_env="positive_control",
                               merge_strategy={"parameters": "soft"})["parameters"]
    settings = verl_cell_settings(params["training"], params["positive_control_verl"], seed=1)
    native_cell = cell_settings(params["training"], "out", seed=1)
    native, gauge = native_cell.trainer, native_cell.validation
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rows = pd.DataFrame({"data_source": ["fitted"], "prompt": [[{"role": "user", "content": "q?"}]]})
    launch = build_launch({"path": str(warm)}, settings.with_method(params["train_grpo"]["method"]).verl_launch(),
                          tmp_path / "run", retrieval_url="http://127.0.0.1:8123", train=rows, validation=rows)
    proc = subprocess.run([*launch.argv, "--cfg", "job"], capture_output=True, text=True, timeout=300, env=launch.env,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    actor, rollout = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["rollout"]
    assert cfg["trainer"]["device"] == "cpu" and rollout["name"] == "spader_decoder"
    assert cfg["data"]["train_batch_size"] == native.prompts_per_step and rollout["n"] == native.group_size
    assert cfg["trainer"]["total_training_steps"] == native.total_steps
    assert actor["ppo_mini_batch_size"] == native.prompts_per_step // native.ppo_mini_batches
    assert rollout["temperature"] == native.temperature and rollout["seed"] == 1 and cfg["data"]["seed"] == 1
    assert rollout["multi_turn"]["max_assistant_turns"] == native.rollout.max_turns
    assert rollout["custom"]["max_turn_tokens"] == native.max_new_tokens
    assert cfg["trainer"]["val_before_train"] is True and rollout["val_kwargs"]["do_sample"] is True
    # the native cells' gauge (conf/positive_control): their fitted questions' draws and temperature
    assert rollout["val_kwargs"]["n"] == gauge.trajectories_of("fitted")
    assert rollout["val_kwargs"]["temperature"] == gauge.sampling_temperature(native.temperature)
    assert cfg["data"]["val_max_samples"] == -1  # every fitted and held-out question
