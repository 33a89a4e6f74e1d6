"""The Ray task of a grid's job: one ``kedro run`` of this project, in a process of its own.

The task runs where Ray placed it, in the project folder (the same path on every node), with the
torch threads of the resources it declared (``OMP_NUM_THREADS``), and returns when its ``kedro run``
ends. Its process dies with the task's worker (:mod:`.child`), so when a worker or its node dies, Ray
runs the task again (``max_retries``) with nothing of the dead attempt still writing, and the run
resumes from what is stored: Kedro skips the finished nodes (``--only-missing-outputs``), training
goes on from its last checkpoint, evaluation from its last answered question.

Any Ray inside the job (a verl launch) is its own: ``RAY_ADDRESS=local`` makes ``ray.init`` start
one on the task's node, over the GPUs Ray gave the task (``CUDA_VISIBLE_DEVICES``), unless the job's
settings name a cluster (``training.verl.ray_address``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import ray


class JobFailed(RuntimeError):
    """A job's ``kedro run`` exited with an error: not run again (it would fail the same way)."""


class JobKilled(RuntimeError):
    """A job's ``kedro run`` was killed by a signal (the kernel's out-of-memory killer, an operator):
    Ray runs it again, as for a worker that died."""


@ray.remote
def run_job(name: str, args: list[str], project: str, threads: int) -> float:
    """``kedro ARGS`` in ``project`` with ``threads`` torch threads; the seconds it took.

    Raises :class:`JobKilled` when a signal ended it, :class:`JobFailed` when it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "RAY_ADDRESS": "local"}
    start = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "spader_pipeline.grid.child", str(os.getpid()), *args],
                           cwd=project, env=env)
    if code < 0:
        raise JobKilled(f"{name}: kedro {' '.join(args)} was killed by {signal.Signals(-code).name}")
    if code:
        raise JobFailed(f"{name}: kedro {' '.join(args)} exited with status {code} (its log is above)")
    return time.monotonic() - start
