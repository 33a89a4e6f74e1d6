"""init_local_ray: a local Ray start that ran out of Ray's fixed windows is retried, after the processes it
left are stopped; any other error is raised at once. Ray's own start is replaced by a stand-in here (its
timeout needs a machine too slow for it); the verl and grid tests start real Rays through the helper."""

from __future__ import annotations

import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

from spader_pipeline.local_ray import init_local_ray, is_startup_timeout  # noqa: E402

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the "
                    "raylet failed to startup or the GCS has become overloaded.")


class FakeInit:
    """``ray.init`` that fails ``failures`` times with ``error``, each failure leaving a child process."""

    def __init__(self, failures: int, error: Exception = TIMEOUT):
        self.failures, self.error = failures, error
        self.calls: list[dict] = []
        self.left: list[subprocess.Popen] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            self.left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
            raise self.error
        return "context"


def test_a_start_that_timed_out_is_retried_after_its_processes_are_stopped(monkeypatch):
    fake = FakeInit(failures=2)
    monkeypatch.setattr(ray, "init", fake)
    assert init_local_ray(num_cpus=2, include_dashboard=False) == "context"
    assert fake.calls == [{"address": "local", "num_cpus": 2, "include_dashboard": False}] * 3
    assert [process.wait(timeout=30) is not None for process in fake.left] == [True, True]


def test_the_last_attempt_raises_the_timeout(monkeypatch):
    fake = FakeInit(failures=5)
    monkeypatch.setattr(ray, "init", fake)
    with pytest.raises(Exception, match="timed out during startup"):
        init_local_ray(attempts=2)
    assert len(fake.calls) == 2
    for process in fake.left:  # the last attempt's processes are Ray's to report on, not ours to stop
        process.kill()
        process.wait()


def test_any_other_error_is_raised_at_once(monkeypatch):
    fake = FakeInit(failures=1, error=ValueError("object_store_memory too large"))
    monkeypatch.setattr(ray, "init", fake)
    with pytest.raises(ValueError, match="object_store_memory"):
        init_local_ray()
    assert len(fake.calls) == 1
    fake.left[0].kill()
    fake.left[0].wait()


def test_it_always_starts_a_new_ray():
    with pytest.raises(TypeError, match="no address"):
        init_local_ray(address="10.0.0.1:6379")
    assert is_startup_timeout(TIMEOUT) and not is_startup_timeout(RuntimeError("connection refused"))
