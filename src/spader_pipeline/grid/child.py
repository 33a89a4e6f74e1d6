"""``python -m spader_pipeline.grid.child PARENT_PID ARGS…``: Kedro's command line (``kedro ARGS…``)
in a process that dies with the Ray worker that started it.

Linux's ``PR_SET_PDEATHSIG`` sends it SIGKILL when its parent dies, so a cell whose worker was killed
leaves no ``kedro run`` behind to write beside the attempt Ray starts next; the run's own children
(the fork server, a training child) end with it, through their lifelines
(:mod:`spader_pipeline.child_process`). Set here, in the new process, rather than through
``subprocess``'s ``preexec_fn``, which is unsafe in a worker's threads. Elsewhere than Linux the
process runs without it.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

#: prctl(2)'s option: the signal this process gets when its parent dies
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Be killed when ``parent`` dies; exit at once if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the line above
        sys.exit(f"the process that started this job (pid {parent}) is gone")


def main(argv: list[str]) -> None:
    die_with_parent(int(argv[0]))
    sys.argv = ["kedro", *argv[1:]]
    runpy.run_module("kedro", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
