"""One ``kedro run`` per data root: a lock file that names its holder (docs/reliability.md).

``<data_root>/.kedro-run.lock`` is created atomically (``O_EXCL``) when a run starts and removed when
it ends; it holds the pid, host, pipeline, Kedro environment and start time of the run. A second run
on the same root stops at once with :class:`DataRootBusy` naming the first. A lock whose process is
gone (a killed run, checked on the same host by pid and process start time) is taken over with a
warning. Different roots (``make run`` beside ``make compare``) never meet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".kedro-run.lock"


class DataRootBusy(RuntimeError):
    """Another run holds the data root."""


@dataclass(frozen=True)
class LockInfo:
    """What a lock file says about the run that holds it."""

    pid: int
    host: str
    pipeline: str
    env: str
    started: str
    """ISO time the run started"""
    token: str
    """unique per acquisition: only the holder removes the lock"""
    process_start: str = ""
    """the holder's start time in ``/proc`` (tells a reused pid from the holder)"""

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, pipeline {self.pipeline!r}, env {self.env!r}, started {self.started}"


def _process_start(pid: int) -> str:
    """The kernel's start time of ``pid`` (``""`` where ``/proc`` is not there)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def holder_alive(info: LockInfo) -> bool:
    """Whether the run that wrote ``info`` may still run (another host's process cannot be checked)."""
    if info.host != socket.gethostname():
        return True
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not info.process_start or _process_start(info.pid) in ("", info.process_start)


def read_lock(path: Path) -> LockInfo | None:
    """The lock at ``path``; ``None`` when it is gone or unreadable."""
    try:
        return LockInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def acquire(data_root: str | Path, pipeline: str, env: str) -> LockInfo:
    """Take the lock of ``data_root`` for this process; raise :class:`DataRootBusy` when a live run holds it."""
    root = Path(data_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    pid = os.getpid()
    info = LockInfo(pid=pid, host=socket.gethostname(), pipeline=pipeline, env=env,
                    started=datetime.now().astimezone().isoformat(timespec="seconds"), token=uuid.uuid4().hex,
                    process_start=_process_start(pid))
    for _ in range(10):  # each turn either takes the lock, stops, or removes one stale lock
        if _create(path, info):
            return info
        holder = read_lock(path)
        if holder is not None and holder_alive(holder):
            raise DataRootBusy(
                f"data root {root} is in use by another kedro run ({holder.describe()}); wait for it to end, "
                f"or run this one on another root (conf/<env>/globals.yml: data_root). If that run is gone, "
                f"delete {path}.")
        if _remove_stale(path, holder):
            logger.warning("took over the lock of data root %s from a run that is gone (%s)", root,
                           holder.describe() if holder else "unreadable lock file")
    raise DataRootBusy(f"could not take the lock {path}: it keeps changing hands")


def _create(path: Path, info: LockInfo) -> bool:
    """Create the lock with its content in one step (a hard link of a written file); ``False`` if it exists."""
    tmp = path.with_name(f"{path.name}.{info.token}")
    with tmp.open("w") as f:
        f.write(json.dumps(asdict(info), indent=1))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale(path: Path, holder: LockInfo | None) -> bool:
    """Remove the stale lock at ``path`` unless another run replaced it meanwhile; ``True`` if removed."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, aside)  # atomic: of two runs taking over, one moves the file
    except FileNotFoundError:
        return False
    moved = read_lock(aside)
    if moved is not None and (holder is None or moved.token != holder.token):  # a new run's lock: put it back
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def release(data_root: str | Path, info: LockInfo) -> None:
    """Remove the lock of ``data_root`` if ``info`` still holds it."""
    path = Path(data_root).resolve() / LOCK_NAME
    current = read_lock(path)
    if current is not None and current.token == info.token:
        path.unlink(missing_ok=True)
