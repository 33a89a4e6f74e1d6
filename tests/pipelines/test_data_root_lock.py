"""One ``kedro run`` per data root (docs/reliability.md): real ``KedroSession`` runs of this project
with its hooks. The first run is held inside its run (a runner that waits, after every
``before_pipeline_run`` hook has run, and runs no node) while the second starts."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.runner import SequentialRunner

from spader_pipeline.run_lock import LOCK_NAME, DataRootBusy


class HeldRunner(SequentialRunner):
    """Signals that the run started, then waits to be let go; runs no node."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.go = threading.Event(), threading.Event()

    def run(self, pipeline, catalog, hook_manager=None, run_id=None, only_missing_outputs=False):
        self.started.set()
        assert self.go.wait(120), "never let go"
        return {}


class HeldRun:
    """A session's run in a thread, held by :class:`HeldRunner` until :meth:`finish`."""

    def __init__(self, project, env: str, pipeline: str) -> None:
        self.runner, self.error = HeldRunner(), None
        self.session = KedroSession.create(project_path=project, env=env)
        self.thread = threading.Thread(target=self._run, args=(pipeline,))
        self.thread.start()
        assert self.runner.started.wait(120), f"run did not start: {self.error}"

    def _run(self, pipeline: str) -> None:
        try:
            self.session.run(pipeline_names=[pipeline], runner=self.runner)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
            self.runner.started.set()
        finally:
            self.session.close()

    def finish(self) -> None:
        self.runner.go.set()
        self.thread.join(60)
        assert self.error is None, self.error


def _run_now(project, env: str, pipeline: str):
    runner = HeldRunner()
    runner.go.set()
    with KedroSession.create(project_path=project, env=env) as session:
        return session.run(pipeline_names=[pipeline], runner=runner)


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
