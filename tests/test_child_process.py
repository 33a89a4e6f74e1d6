"""``in_child_process``: results, errors and deaths of a real child (forked from the fork server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spader_pipeline.child_process import ChildProcessDied, in_child_process


class Unpicklable(Exception):
    def __init__(self, handle):
        super().__init__("holds a lock")
        self.handle = handle

    def __reduce__(self):
        raise TypeError("cannot pickle")


def pid_and_total(values, *, scale=1):
    return os.getpid(), sum(values) * scale


def fail_with_value_error(message):
    raise ValueError(message)


def fail_unpicklably():
    import threading

    raise Unpicklable(threading.Lock())


def die_by_sigkill():
    os.kill(os.getpid(), signal.SIGKILL)


def torch_threads():
    import torch

    return torch.get_num_threads()


def test_runs_in_another_process_and_returns_the_result():
    pid, total = in_child_process(pid_and_total)([1, 2, 3], scale=10)
    assert total == 60 and pid != os.getpid()


def test_disabled_runs_here():
    assert in_child_process(pid_and_total, enabled=False)([1])[0] == os.getpid()


def test_child_exception_is_raised_here_with_its_traceback():
    with pytest.raises(ValueError, match="bad row 7") as info:
        in_child_process(fail_with_value_error)("bad row 7")
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "in the child process" in notes and "fail_with_value_error" in notes


def test_unpicklable_exception_arrives_as_text():
    with pytest.raises(RuntimeError, match="Unpicklable: holds a lock"):
        in_child_process(fail_unpicklably)()


def test_killed_child_is_a_clear_error():
    with pytest.raises(ChildProcessDied, match=r"die_by_sigkill: the child process \d+ ended without a result "
                                               r"\(exit code -9"):
        in_child_process(die_by_sigkill)()


def test_child_keeps_the_parents_torch_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert in_child_process(torch_threads)() == 1
    finally:
        torch.set_num_threads(before)


def log_a_warning(text):
    import logging

    logging.getLogger("spader_pipeline.some_stage").warning("from the child: %s", text)
    logging.getLogger("spader_pipeline.some_stage").debug("below the parent's level")


def test_child_logs_reach_the_parents_loggers(caplog):
    import logging

    with caplog.at_level(logging.INFO):
        in_child_process(log_a_warning)("hello")
    records = [r for r in caplog.records if r.name == "spader_pipeline.some_stage"]
    assert [r.getMessage() for r in records] == ["from the child: hello"]
    assert records[0].processName == "log_a_warning"


def environment_directory_and_modules(name):
    preloaded = {"torch", "spader_pipeline.native.stages", "spader_pipeline.native.trainer"}
    return os.environ.get(name), os.getcwd(), sorted(set(sys.modules) & preloaded)


def test_child_runs_in_the_callers_environment_and_directory_at_the_call(tmp_path, monkeypatch):
    in_child_process(pid_and_total)([1])  # the fork server is up, with the environment of then
    monkeypatch.setenv("SPADER_CHILD_TEST", "set after the server started")
    monkeypatch.chdir(tmp_path)
    value, directory, modules = in_child_process(environment_directory_and_modules)("SPADER_CHILD_TEST")
    assert value == "set after the server started" and Path(directory) == tmp_path
    # imported by the server, not by the child (this module imports neither)
    assert modules == ["spader_pipeline.native.stages", "spader_pipeline.native.trainer", "torch"]


PARENT = """
import sys, time
from spader_pipeline import child_process
from test_child_process import sleep_and_report
if __name__ == "__main__":
    sys.platform = sys.argv[2]  # "darwin": spawned
    child_process.in_child_process(sleep_and_report)(sys.argv[1])
"""


def sleep_and_report(path):
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_child_ends_when_its_caller_is_killed(tmp_path, platform):
    """SIGKILL on the caller ends the child, forked (its parent is the fork server) or spawned."""
    pid_file = tmp_path / "child.pid"
    caller = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file), platform], cwd=Path(__file__).parent,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    try:
        for _ in range(600):  # the caller starts the server (its imports) and the child
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        child = int(pid_file.read_text())
        caller.kill()
        caller.wait()
        for _ in range(300):
            if not _alive(child):
                break
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        caller.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_elsewhere_than_linux_the_child_is_spawned(tmp_path, monkeypatch):
    """macOS and Windows spawn (a fork of a process that loaded torch may crash on macOS): a fresh
    interpreter, with the caller's environment and directory all the same."""
    from spader_pipeline import child_process

    monkeypatch.setattr(child_process.sys, "platform", "darwin")
    assert child_process._context().get_start_method() == "spawn"
    monkeypatch.setenv("SPADER_CHILD_TEST", "spawned")
    monkeypatch.chdir(tmp_path)
    value, directory, _ = in_child_process(environment_directory_and_modules)("SPADER_CHILD_TEST")
    assert value == "spawned" and Path(directory) == tmp_path


def test_the_server_can_start_before_the_first_child_and_serves_it():
    """``start_server`` starts the fork server (with its preloaded modules) and returns at once;
    the next child is forked from it; elsewhere than Linux there is none to start."""
    from multiprocessing import forkserver

    from spader_pipeline import child_process

    assert child_process.start_server() is (sys.platform.startswith("linux"))
    if sys.platform.startswith("linux"):
        pid = forkserver._forkserver._forkserver_pid
        assert pid is not None and _alive(pid)
        value, _, modules = in_child_process(environment_directory_and_modules)("HOME")
        assert forkserver._forkserver._forkserver_pid == pid  # the same server: started once
        assert "spader_pipeline.native.trainer" in modules  # preloaded


def test_a_run_starts_the_server_only_for_nodes_that_run_children(monkeypatch):
    """The hook's decision (``ForkServerHooks``): a pipeline with a node marked
    ``runs_child_processes`` run here starts it; one without, or run on ParallelRunner, does not."""
    from kedro.pipeline import Pipeline, node

    from spader_pipeline import child_process
    from spader_pipeline.hooks import ForkServerHooks
    from spader_pipeline.pipelines.training.nodes import train_policy

    started = []
    monkeypatch.setattr(child_process, "start_server", lambda: started.append(True) or True)
    heavy = Pipeline([node(train_policy, ["a", "b", "c", "d", "e", "f"], ["g", "h", "i"])])
    light = Pipeline([node(len, "x", "y")])
    hooks = ForkServerHooks()
    hooks.before_pipeline_run({"runner": "SequentialRunner"}, light, None)
    assert started == []
    hooks.before_pipeline_run({"runner": "<kedro.runner.parallel_runner.ParallelRunner object at 0x1>"}, heavy, None)
    assert started == []
    hooks.before_pipeline_run({"runner": "SequentialRunner"}, heavy, None)
    assert started == [True]
