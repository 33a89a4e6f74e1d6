"""Run a long command (verl's trainer, its checkpoint merger) to its end: each output line streamed to
the log and a file, a timeout that stops the whole process group, and an error that carries the
log's last lines."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


class VerlLaunchError(RuntimeError):
    """VERL exited with an error; the message ends with the tail of its log."""


def run_streaming(
    argv: Sequence[str], env: Mapping[str, str], log_path: str | Path, *, tail_lines: int = 80, timeout: float | None = None,
    cwd: str | Path | None = None,
) -> None:
    """Run ``argv``, streaming each output line to the logger and ``log_path``.

    Raises :class:`VerlLaunchError` with the last ``tail_lines`` lines when the process fails or
    exceeds ``timeout`` seconds (the process group is stopped).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    started = time.monotonic()
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)
        timer = None
        timed_out = threading.Event()
        if timeout:
            def _stop() -> None:
                timed_out.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
            timer = threading.Timer(timeout, _stop)
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                log_file.write(line + "\n")
                logger.info("[verl] %s", line)
            code = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
    if timed_out.is_set():
        raise VerlLaunchError(f"VERL exceeded {timeout} s and was stopped; last lines of {log_path}:\n" + "\n".join(tail))
    if code != 0:
        raise VerlLaunchError(
            f"VERL exited with code {code} after {time.monotonic() - started:.0f} s; last lines of {log_path}:\n"
            + "\n".join(tail)
        )
