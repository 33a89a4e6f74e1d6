"""What a grid asks of Ray (:mod:`spader_pipeline.grid.settings`), how it reads a pipeline
(:mod:`spader_pipeline.grid.phases`), and the process of a job dying with its worker
(:mod:`spader_pipeline.grid.child`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from kedro.pipeline import Pipeline, node, pipeline

from spader_pipeline.grid.driver import job_environment
from spader_pipeline.grid.phases import kedro_args, split
from spader_pipeline.grid.settings import GIB, GridSettings, Node, Resources, cell_options, shared_options
from spader_pipeline.run_lock import CELL_TAG
from spader_pipeline.typed_config import SettingsError

LAPTOP = [Node(cpus=2, memory=20 * GIB)]


def test_a_cells_share_of_the_largest_node_is_its_cpus_over_the_cells_that_fit_at_once():
    five = Resources(memory_gib=5)
    # 2 cores, room for 4 cells of 5 GiB: 4 at once, half a CPU and one thread each (make positive-control)
    assert (cell_options(five, LAPTOP, 4).num_cpus, cell_options(five, LAPTOP, 4).threads) == (0.5, 1)
    assert cell_options(five, [Node(cpus=2, memory=12 * GIB)], 4).num_cpus == 1  # 2 fit: a core each
    assert cell_options(five, [Node(cpus=16, memory=64 * GIB)], 4).threads == 4
    assert cell_options(five, [Node(cpus=2, memory=20 * GIB)], 3).num_cpus == 0.6666
    assert cell_options(five, [Node(cpus=16, memory=64 * GIB)], 6).num_cpus == 2  # 16 / 6, whole CPUs
    # the largest node decides; a GPU per cell: as many at once as it has GPUs
    gpus = [Node(cpus=4, memory=8 * GIB), Node(cpus=32, gpus=2, memory=256 * GIB)]
    assert cell_options(Resources(num_gpus=1, memory_gib=5), gpus, 6).ray_options() == {
        "num_cpus": 16, "num_gpus": 1, "memory": 5 * GIB}
    assert cell_options(Resources(num_cpus=1.5), LAPTOP, 4).threads == 1  # set: taken as it is
    assert shared_options(Resources(), LAPTOP).ray_options() == {"num_cpus": 2, "num_gpus": 0.0}


def test_the_grid_block_is_typed_and_a_misspelt_key_names_its_path():
    settings = GridSettings.from_mapping({"cell": {"num_cpus": 1, "memory_gib": 5}, "max_retries": 2})
    assert settings.cell == Resources(num_cpus=1, memory_gib=5) and settings.shared == Resources()
    with pytest.raises(SettingsError, match=r"grid\.cell\.num_cpu"):
        GridSettings.from_mapping({"cell": {"num_cpu": 1}})
    with pytest.raises(SettingsError, match=r"grid\.cell.*num_cpus=0"):
        GridSettings.from_mapping({"cell": {"num_cpus": 0}})
    with pytest.raises(SettingsError, match=r"grid\.max_retries='3'"):
        GridSettings.from_mapping({"max_retries": "3"})


def test_cells_of_another_kind_ask_for_their_own_resources_and_share_the_node_among_their_kind():
    settings = GridSettings.from_mapping({"cell": {"memory_gib": 5},
                                          "cells": {"*_verl_seed*": {"memory_gib": 10}, "big_*": {"num_cpus": 4}}})
    assert settings.resources_for("fit_grpo_verl_seed0") == Resources(memory_gib=10)
    assert settings.resources_for("fit_grpo_seed0") == settings.cell and settings.pattern_of("fit_grpo_seed0") is None
    cells = ["fit_grpo_seed0", "fit_grpo_verl_seed0", "fit_spader_seed0", "fit_spader_verl_seed0"]
    groups = settings.cell_groups(cells)
    assert groups == [(Resources(memory_gib=5), ["fit_grpo_seed0", "fit_spader_seed0"]),
                      (Resources(memory_gib=10), ["fit_grpo_verl_seed0", "fit_spader_verl_seed0"])]
    # 2 cores, 20 GiB: the native cells a core each (2 of their kind), the verl cells a core each (2 fit at 10 GiB)
    assert [cell_options(r, LAPTOP, len(g)).num_cpus for r, g in groups] == [1, 1]
    assert cell_options(Resources(memory_gib=12), LAPTOP, 2).threads == 2  # one at once: the whole node
    # more memory than the largest node has: all of it (it runs alone there), never a job Ray cannot place
    small = [Node(cpus=2, memory=9 * GIB)]
    assert cell_options(Resources(memory_gib=12), small, 2).ray_options() == {"num_cpus": 2, "num_gpus": 0.0,
                                                                             "memory": 9 * GIB}
    assert cell_options(Resources(num_cpus=1, memory_gib=12), small, 2).memory == 9 * GIB
    with pytest.raises(SettingsError, match=r"grid\.cells\.\*_verl_seed\*\.memory_gb"):
        GridSettings.from_mapping({"cells": {"*_verl_seed*": {"memory_gb": 10}}})


def _cell(name: str) -> Pipeline:
    template = Pipeline([node(lambda shared: shared, "shared", "trained", name="train"),
                         node(lambda trained: trained, "trained", "scored", name="score")], tags=[CELL_TAG])
    return pipeline(template, namespace=name, inputs={"shared"}, outputs={"scored": f"{name}__scored"})


def test_a_pipeline_is_read_as_its_shared_part_its_cells_and_their_report():
    grid = split(Pipeline([node(lambda: 1, None, "shared", name="prepare"), _cell("a_seed0"), _cell("a_seed1"),
                           node(lambda x, y: x + y, ["a_seed0__scored", "a_seed1__scored"], "report", name="report")]))
    assert [n.name for n in grid.shared.nodes] == ["prepare"]
    assert sorted(grid.cells) == ["a_seed0", "a_seed1"] and len(grid.cells["a_seed1"].nodes) == 2
    assert [n.name for n in grid.report.nodes] == ["report"]
    assert kedro_args("compare", "compare", cell="a_seed0") == [
        "run", "--env", "compare", "--pipeline", "compare", "--namespaces", "a_seed0", "--only-missing-outputs"]
    assert kedro_args("e", "p", nodes=grid.shared)[5:] == ["--nodes", "prepare", "--only-missing-outputs"]
    leaning = pipeline(Pipeline([node(lambda s, o: s, ["shared", "a_seed0__scored"], "x", name="lean")],
                                tags=[CELL_TAG]), namespace="b_seed0", inputs={"shared", "a_seed0__scored"})
    with pytest.raises(ValueError, match="cell b_seed0 .* reads \\['a_seed0__scored'\\], written by other cells"):
        split(Pipeline([node(lambda: 1, None, "shared", name="prepare"), _cell("a_seed0"), leaning]))
    with pytest.raises(ValueError, match="has no cells"):
        split(Pipeline([node(lambda: 1, None, "shared", name="prepare")]), "data_prep")


def test_every_job_gets_the_drivers_switches_and_not_its_mlflow_run():
    environ = {"SPADER_BF16": "off", "MLFLOW_TRACKING_URI": "sqlite:///x.db", "MLFLOW_RUN_ID": "abc", "HOME": "/root",
               "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/p"}
    assert job_environment(environ) == {"SPADER_BF16": "off", "MLFLOW_TRACKING_URI": "sqlite:///x.db",
                                        "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/p"}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


#: the job's process: what the job's launcher does first (die_with_parent), then its pid to argv[2]
JOB = """
import os, sys, time
from spader_pipeline.grid.child import die_with_parent
die_with_parent(int(sys.argv[1]))
open(sys.argv[2], "w").write(str(os.getpid()))
time.sleep(600)
"""
#: a stand-in for a Ray worker: it starts the job's process and waits
WORKER = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_jobs_process_dies_with_the_worker_that_started_it(tmp_path):
    pid_file = tmp_path / "job.pid"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, JOB, str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and worker.poll() is None, "the job did not start"
            time.sleep(0.05)
        job = int(pid_file.read_text())
        assert _alive(job)
        os.kill(worker.pid, signal.SIGKILL)  # the worker dies
        worker.wait(30)
        deadline = time.monotonic() + 10
        while _alive(job):
            if time.monotonic() > deadline:
                os.kill(job, signal.SIGKILL)
                pytest.fail("the job outlived its worker")
            time.sleep(0.05)
    finally:
        if worker.poll() is None:
            worker.kill()
