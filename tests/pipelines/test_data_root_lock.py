"""Who may write in a data root (docs/reliability.md): the lock files and their lease
(:mod:`spader_pipeline.run_lock`), and real ``KedroSession`` runs of this project with its hooks.
A held run is held inside its run (a runner that waits, after every ``before_pipeline_run`` hook
has run, and runs no node) while the others start; another host is simulated by the host name the
locks record (``run_lock.hostname``)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.runner import SequentialRunner

from spader_pipeline import run_lock
from spader_pipeline.run_lock import CELLS_DIR, LOCK_NAME, DataRootBusy, cell_lock_path, root_lock_path

#: the comparison's shared part and its report, as whole-root runs (before or after the cells)
SHARED_PART = {"to_nodes": ["validate_warm_start", "select_heldout", "evaluate_references"]}
REPORT = {"node_names": ["gather_cells", "compare_report"]}


class HeldRunner(SequentialRunner):
    """Signals that the run started, then waits to be let go; runs no node."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.go = threading.Event(), threading.Event()

    def run(self, pipeline, catalog, hook_manager=None, run_id=None, only_missing_outputs=False):
        self.started.set()
        assert self.go.wait(900), "never let go"
        return {}


class HeldRun:
    """A session's run in a thread, held by :class:`HeldRunner` until :meth:`finish`."""

    def __init__(self, project, env: str, pipeline: str, **run_args) -> None:
        self.runner, self.error = HeldRunner(), None
        self.session = KedroSession.create(project_path=project, env=env)
        self.thread = threading.Thread(target=self._run, args=(pipeline,), kwargs=run_args)
        self.thread.start()
        assert self.runner.started.wait(120), f"run did not start: {self.error}"

    def _run(self, pipeline: str, **run_args) -> None:
        try:
            self.session.run(pipeline_names=[pipeline], runner=self.runner, **run_args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
            self.runner.started.set()
        finally:
            self.session.close()

    def finish(self) -> None:
        self.runner.go.set()
        self.thread.join(60)
        assert self.error is None, self.error


def _run_now(project, env: str, pipeline: str, **run_args):
    runner = HeldRunner()
    runner.go.set()
    with KedroSession.create(project_path=project, env=env) as session:
        return session.run(pipeline_names=[pipeline], runner=runner, **run_args)


def test_a_second_run_on_the_same_root_stops_at_once_naming_the_first(kedro_project):
    lock = kedro_project / "data" / LOCK_NAME
    first = HeldRun(kedro_project, "test", "data_prep")
    try:
        holder = json.loads(lock.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert holder["pipeline"] == "data_prep" and holder["env"] == "test" and holder["started"]
        runs_before = len(mlflow.search_runs(search_all_experiments=True, output_format="list"))
        with pytest.raises(DataRootBusy) as busy:
            _run_now(kedro_project, "test", "index_build")
        message = str(busy.value)
        assert f"pid {os.getpid()}" in message and "'data_prep'" in message and holder["started"] in message
        assert str(kedro_project / "data") in message
        assert len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == runs_before
        assert json.loads(lock.read_text())["token"] == holder["token"]  # the first run still holds it
    finally:
        first.finish()
    assert not lock.exists()
    _run_now(kedro_project, "test", "index_build")  # the root is free again


def test_runs_on_different_data_roots_go_side_by_side(kedro_project):
    chain = HeldRun(kedro_project, "test", "data_prep")
    try:
        compare = HeldRun(kedro_project, "compare", "data_prep")  # data_root: data/compare
        assert (kedro_project / "data" / LOCK_NAME).exists()
        assert json.loads((kedro_project / "data" / "compare" / LOCK_NAME).read_text())["env"] == "compare"
        compare.finish()
    finally:
        chain.finish()


def test_a_lock_whose_process_is_gone_is_taken_over_with_a_warning(kedro_project, caplog):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = kedro_project / "data" / LOCK_NAME
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(), "pipeline": "training",
                                "env": "local", "started": "2026-11-25T03:00:00+00:00", "token": "killed"}))
    with caplog.at_level(logging.WARNING, logger="spader_pipeline.run_lock"):
        _run_now(kedro_project, "test", "index_build")
    assert "took over" in caplog.text and f"pid {int(gone.stdout)}" in caplog.text and "'training'" in caplog.text
    assert not lock.exists()


# --- cells: a run made only of compare cells holds those cells, not the whole root ---

def test_cells_run_side_by_side_and_the_same_cell_twice_is_refused_naming_its_holder(kedro_project):
    data = kedro_project / "data"
    first = HeldRun(kedro_project, "test", "compare", namespaces=["grpo_seed0"])
    try:
        holder = json.loads((data / CELLS_DIR / "grpo_seed0.lock").read_text())
        assert holder["cells"] == ["grpo_seed0"] and holder["pipeline"] == "compare" and holder["started"]
        assert not (data / LOCK_NAME).exists()  # the root is not held whole

        _run_now(kedro_project, "test", "compare", namespaces=["spader_seed0"])  # another cell: beside it

        with pytest.raises(DataRootBusy) as busy:  # the same cell again
            _run_now(kedro_project, "test", "compare", namespaces=["grpo_seed0"])
        message = str(busy.value)
        assert message.startswith(f"cell grpo_seed0 of data root {data} is in use")
        for part in (f"pid {os.getpid()}", f"host {socket.gethostname()}", "pipeline 'compare'", holder["started"]):
            assert part in message
        # the shared part and the report wait for every cell
        for phase in (SHARED_PART, REPORT):
            with pytest.raises(DataRootBusy, match=re.escape(f"data root {data} has a cell running (pid {os.getpid()}")):
                _run_now(kedro_project, "test", "compare", **phase)
    finally:
        first.finish()
    assert not list((data / CELLS_DIR).glob("*.lock"))


def test_cells_from_two_hosts_run_side_by_side_and_a_whole_root_run_excludes_them(kedro_project, monkeypatch):
    data = kedro_project / "data"
    here = HeldRun(kedro_project, "test", "compare", namespaces=["grpo_seed1"])
    try:
        monkeypatch.setattr(run_lock, "hostname", lambda: "node-b")  # this process is now another host
        there = HeldRun(kedro_project, "test", "compare", namespaces=["spader_seed1"])
        try:
            assert json.loads((data / CELLS_DIR / "spader_seed1.lock").read_text())["host"] == "node-b"
            with pytest.raises(DataRootBusy, match="cell grpo_seed1 .*on host " + re.escape(socket.gethostname())):
                _run_now(kedro_project, "test", "compare", namespaces=["grpo_seed1"])
        finally:
            there.finish()
    finally:
        here.finish()
    # a run that writes the shared outputs holds the whole root: no cell beside it, from any host
    shared = HeldRun(kedro_project, "test", "compare", **SHARED_PART)
    try:
        assert json.loads((data / LOCK_NAME).read_text())["cells"] == []
        monkeypatch.setattr(run_lock, "hostname", lambda: "node-c")
        with pytest.raises(DataRootBusy, match=re.escape(f"data root {data} is held whole by another kedro run "
                                                         f"(pid {os.getpid()} on host node-b")):
            _run_now(kedro_project, "test", "compare", namespaces=["grpo_seed0"])
        assert not (data / CELLS_DIR / "grpo_seed0.lock").exists()  # the refused cell left nothing behind
    finally:
        shared.finish()


# --- the lease: a lock not renewed for its lease is stale on any host ---

def _age(path, seconds: float) -> None:
    """Make the lock at ``path`` look last renewed ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_another_hosts_lock_holds_while_renewed_and_is_taken_over_once_its_lease_ran_out(tmp_path, monkeypatch,
                                                                                         caplog):
    monkeypatch.setattr(run_lock, "hostname", lambda: "node-b")
    there = run_lock.acquire(tmp_path, "compare", "compare", cells=["grpo_seed0"], lease_seconds=600,
                             renew_seconds=3600)
    monkeypatch.setattr(run_lock, "hostname", lambda: "node-a")
    path = cell_lock_path(tmp_path, "grpo_seed0")
    _age(path, 300)  # the holder's pid is alive here, but it is another host's: only the lease counts
    with pytest.raises(DataRootBusy, match="cell grpo_seed0 .*on host node-b.*lease renewed"):
        run_lock.acquire(tmp_path, "compare", "compare", cells=["grpo_seed0"])
    with pytest.raises(DataRootBusy, match="has a cell running .*on host node-b"):
        run_lock.acquire(tmp_path, "compare", "compare")
    assert not root_lock_path(tmp_path).exists()  # the refused run left nothing behind

    _age(path, 700)  # node-b stopped renewing (its machine died)
    with caplog.at_level(logging.WARNING, logger="spader_pipeline.run_lock"):
        here = run_lock.acquire(tmp_path, "compare", "compare")  # the whole root, over the stale cell
    assert "took over" in caplog.text and "on host node-b" in caplog.text and "its lease ran out" in caplog.text
    assert not path.exists() and root_lock_path(tmp_path).exists()

    with caplog.at_level(logging.ERROR, logger="spader_pipeline.run_lock"):
        there.renew()  # node-b wakes up: it does not renew a lock it lost
    assert "lost its lock" in caplog.text
    there.release()  # ... nor remove another run's
    assert json.loads(root_lock_path(tmp_path).read_text())["token"] == here.info.token
    here.release()
    assert not root_lock_path(tmp_path).exists()


def test_a_live_same_host_lock_is_stale_once_its_lease_ran_out(tmp_path, caplog):
    held = run_lock.acquire(tmp_path, "compare", "compare", cells=["spader_seed2"], renew_seconds=3600)
    path = cell_lock_path(tmp_path, "spader_seed2")
    with pytest.raises(DataRootBusy):
        run_lock.acquire(tmp_path, "compare", "compare", cells=["spader_seed2"])
    _age(path, run_lock.LEASE_SECONDS + 1)  # alive, but not renewed (e.g. stopped): stale on any host
    with caplog.at_level(logging.WARNING, logger="spader_pipeline.run_lock"):
        again = run_lock.acquire(tmp_path, "compare", "compare", cells=["spader_seed2"])
    assert "its lease ran out" in caplog.text
    held.release()
    assert json.loads(path.read_text())["token"] == again.info.token
    again.release()


def test_the_holder_renews_its_lease_in_the_background(tmp_path):
    held = run_lock.acquire(tmp_path, "data_prep", "test", renew_seconds=0.01)
    try:
        path = root_lock_path(tmp_path)
        _age(path, 3600)
        old = path.stat().st_mtime
        for _ in range(12_000):  # wait for the renewal thread's next turn (it runs every 10 ms)
            if path.stat().st_mtime > old:
                break
            time.sleep(0.01)
        assert time.time() - path.stat().st_mtime < 3000
    finally:
        held.release()
    assert not path.exists()


def test_a_lock_written_by_a_newer_version_still_names_its_holder(tmp_path):
    path = root_lock_path(tmp_path)
    path.write_text(json.dumps({"pid": 1, "host": "node-z", "pipeline": "compare", "env": "compare", "token": "t",
                                "started": "2026-11-25T03:00:00+00:00", "cells": [], "priority": "high"}))
    with pytest.raises(DataRootBusy, match="pid 1 on host node-z, pipeline 'compare'"):
        run_lock.acquire(tmp_path, "compare", "compare", cells=["grpo_seed0"])


def test_make_runs_methods_side_by_side_as_cells_while_the_parts_around_them_hold_the_root(kedro_project):
    """``make run``'s middle phase: each method's training node alone is a cell of the default chain's
    root, so the two run side by side; the parts before and after hold the whole root and wait."""
    data = kedro_project / "data"
    first = HeldRun(kedro_project, "test", "__default__", node_names=["train_grpo.train_policy"])
    try:
        assert json.loads((data / CELLS_DIR / "train_grpo.lock").read_text())["cells"] == ["train_grpo"]
        _run_now(kedro_project, "test", "__default__", node_names=["train_spader.train_policy"])  # beside it
        for phase in ("default_before_methods", "default_after_methods"):
            with pytest.raises(DataRootBusy, match=re.escape(f"data root {data} has a cell running")):
                _run_now(kedro_project, "test", phase)
    finally:
        first.finish()
    assert not list((data / CELLS_DIR).glob("*.lock"))


# --- a grid's jobs: under their driver's hold, no lock of their own ---

def test_a_grids_jobs_run_under_its_drivers_hold_and_not_once_the_hold_is_gone(kedro_project, monkeypatch):
    """The driver holds the whole root; its shared part and its cells, side by side, take no lock and
    run while the root lock carries the token they were handed; without it they are refused."""
    data = kedro_project / "data"
    driver = run_lock.acquire(data, "compare", "test")
    monkeypatch.setenv(run_lock.HOLD_ENV, driver.info.token)
    cell = HeldRun(kedro_project, "test", "compare", namespaces=["grpo_seed0"])
    try:
        _run_now(kedro_project, "test", "compare", namespaces=["spader_seed0"])  # beside it
        _run_now(kedro_project, "test", "compare", **SHARED_PART)  # the driver holds the root for it
        assert not (data / CELLS_DIR).exists() and json.loads((data / LOCK_NAME).read_text())["token"] == driver.info.token
    finally:
        cell.finish()
    monkeypatch.setenv(run_lock.HOLD_ENV, "another-grid")
    with pytest.raises(DataRootBusy, match=re.escape(f"but it is held by another run ({driver.info.describe()})")):
        _run_now(kedro_project, "test", "compare", namespaces=["grpo_seed1"])
    monkeypatch.setenv(run_lock.HOLD_ENV, driver.info.token)
    driver.release()
    with pytest.raises(DataRootBusy, match="nothing holds it now: the grid that started it has ended"):
        _run_now(kedro_project, "test", "compare", namespaces=["grpo_seed1"])
    assert not (data / LOCK_NAME).exists()
