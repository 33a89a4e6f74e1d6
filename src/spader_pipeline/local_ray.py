"""Starting a Ray of our own on this machine, also where its startup is slow.

Ray's local start has two fixed windows, neither of them a setting: the raylet aborts when its
dashboard agent (a Python process that imports grpc, aiohttp and Ray's dashboard modules) has not
written its port file within about 15 s ("Timed out waiting for file .../metrics_agent_port_..." in
the session's ``raylet.out``), and ``ray.init`` gives up when the raylet has not registered within
30 s ("The current node timed out during startup"). A slow or busy machine misses them: a 2-vCPU
virtual machine beside a test worker, or a first start whose imports compile their bytecode
(docs/reliability.md, "A Ray of our own").

:func:`init_local_ray` starts a new Ray (never one found on the machine) and retries a start that
timed out: the processes the failed attempt left (its GCS, dashboard head, monitors, reaper: this
process's children) are stopped first, and the next attempt finds the agent's bytecode compiled and
its files in the page cache. Any other error is raised at once.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = "timed out during startup"  # ray._private.node: the raylet never registered
ATTEMPTS = 3


def is_startup_timeout(error: BaseException) -> bool:
    """Whether ``error`` is Ray's local start running out of its fixed windows."""
    return STARTUP_TIMEOUT in str(error)


def init_local_ray(*, attempts: int = ATTEMPTS, **init_kwargs: Any) -> Any:
    """``ray.init(address="local", **init_kwargs)``, tried up to ``attempts`` times while it times out.

    Returns what ``ray.init`` returns. ``address`` is not an argument: a Ray of our own is always a new
    one, whatever ``RAY_ADDRESS`` or ``/tmp/ray/ray_current_cluster`` name (connect to a cluster with
    ``ray.init(address=...)`` itself).
    """
    import psutil
    import ray

    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    if "address" in init_kwargs:
        raise TypeError("init_local_ray starts a new Ray on this machine; it takes no address")
    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {child.pid for child in me.children(recursive=True)}
        try:
            return ray.init(address="local", **init_kwargs)
        except Exception as error:
            if not is_startup_timeout(error) or attempt == attempts:
                raise
            left = [child for child in me.children(recursive=True) if child.pid not in before]
            _stop(left)
            logger.warning("Ray's local start timed out (attempt %d of %d; its agents started slower than "
                           "Ray's fixed windows allow); %d of its processes stopped, starting again",
                           attempt, attempts, len(left))
    raise AssertionError("unreachable")


def _stop(processes: list, grace_s: float = 5.0) -> None:
    """Terminate ``processes`` (psutil), then kill what is still running after ``grace_s``."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
