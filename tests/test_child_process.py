"""``in_child_process``: results, errors and deaths of a real spawned child."""

from __future__ import annotations

import os
import signal

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
