"""Who may write in a data root: lock files that name their holder, renewed on a lease
(docs/reliability.md, "One run per data root, one job per cell").

Two kinds of lock live in a data root:

- ``<data_root>/.kedro-run.lock`` holds the **whole root**: a run that writes shared outputs (the
  default chain, the comparison's shared part or its report).
- ``<data_root>/.kedro-run.cells/<cell>.lock`` holds **one cell** (a namespace that writes only its
  own outputs, e.g. ``grpo_seed0`` of ``make compare``). Cell locks are the root's shared holds:
  different cells run side by side, the same cell once, and no cell beside a whole-root run.

A lock is created atomically with its content (a written file hard-linked to the lock's name, which
fails when the name exists, on local disks and on NFS alike) and holds the pid, host, pipeline,
cells, Kedro environment and start time of its run. Mutual exclusion of the two kinds is
create-then-check: a whole-root run creates its lock and then looks for live cell locks; a cell
run creates its cell lock and then looks for a live root lock. Of two runs that start together at
least one sees the other and backs off, so both may be refused, never both admitted.

A lock is stale, and the next run takes it over with a warning, when

- its lease ran out: the holder renews the file's modification time every :data:`RENEW_SECONDS`
  from a background thread, and a lock not renewed for its lease (:data:`LEASE_SECONDS`, written in
  the lock) is stale on any host; or
- its holder is gone, on the same host: the pid is checked together with the process's start
  time, so a reused pid does not count.

A grid on Ray (:mod:`spader_pipeline.grid`) holds the whole root in its driver for the grid's life,
and its jobs (the shared part, each cell) run under that hold: they find the driver's token in
:data:`HOLD_ENV` and only check that the root lock still carries it (:func:`check_hold`), taking no
lock of their own. Ray runs each cell once at a time and retries it where it died, so the jobs of a
grid need no cell locks; the cell locks serve jobs started side by side by hand or by ``make run``.

Files rather than ``fcntl``/``flock`` locks: those need the shared filesystem's lock manager,
and a mount without one (``nolock``) grants every lock locally, so two hosts would both hold it
silently; a file and a lease need only an atomic create and a settable modification time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

logger = logging.getLogger(__name__)

#: Kedro tag of a cell's nodes (a compare cell, a method's training run of the default chain): a run
#: made only of such nodes writes only their namespaces, and holds their cell locks (the pipelines
#: tag their nodes, the hooks read the tags).
CELL_TAG = "cell"
LOCK_NAME = ".kedro-run.lock"
#: The folder of the cell locks, beside the root lock.
CELLS_DIR = ".kedro-run.cells"
#: A lock not renewed for this long is stale on any host.
LEASE_SECONDS = 300.0
#: How often a holder renews its locks.
RENEW_SECONDS = 30.0
#: Environment variable of a grid's jobs: the token of the root lock their driver holds for them.
HOLD_ENV = "SPADER_DATA_ROOT_HOLD"


class DataRootBusy(RuntimeError):
    """Another run holds the data root, or the cell this run would write."""


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
    """unique per acquisition: only the holder removes or renews the lock"""
    process_start: str = ""
    """the holder's start time in ``/proc`` (tells a reused pid from the holder)"""
    cells: tuple[str, ...] = ()
    """the cells the run holds; empty for a whole-root run"""
    lease_seconds: float = LEASE_SECONDS
    """the holder's lease: not renewed for this long, the lock is stale"""

    def describe(self) -> str:
        cells = f", cells {','.join(self.cells)}" if self.cells else ""
        return (f"pid {self.pid} on host {self.host}, pipeline {self.pipeline!r}{cells}, env {self.env!r}, "
                f"started {self.started}")


def hostname() -> str:
    """This host's name as locks record it."""
    return socket.gethostname()


def _process_start(pid: int) -> str:
    """The kernel's start time of ``pid`` (``""`` where ``/proc`` is not there)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def stale_reason(info: LockInfo, renewed: float, now: float | None = None) -> str | None:
    """Why the run that wrote ``info`` (lock last renewed at ``renewed``, a POSIX time) no longer
    holds it, or ``None`` while it may still run."""
    age = (time.time() if now is None else now) - renewed
    if age > info.lease_seconds:
        return f"its lease ran out: not renewed for {age:.0f} s (lease {info.lease_seconds:.0f} s)"
    if info.host != hostname():
        return None  # another host's process cannot be checked: the lease decides
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return "its process is gone"
    except PermissionError:
        return None
    if info.process_start and _process_start(info.pid) not in ("", info.process_start):
        return "its pid belongs to another process now"
    return None


def read_lock(path: Path) -> LockInfo | None:
    """The lock at ``path``; ``None`` when it is gone or unreadable (fields it does not know are
    ignored, so a lock written by a newer version still names its holder)."""
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(LockInfo)}
        info = LockInfo(**{k: v for k, v in data.items() if k in known})
        return dataclasses.replace(info, cells=tuple(info.cells), lease_seconds=float(info.lease_seconds))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def root_lock_path(data_root: str | Path) -> Path:
    return Path(data_root).resolve() / LOCK_NAME


def cell_lock_path(data_root: str | Path, cell: str) -> Path:
    if not cell or "/" in cell or cell.startswith("."):
        raise ValueError(f"not a cell name: {cell!r}")
    return Path(data_root).resolve() / CELLS_DIR / f"{cell}.lock"


class HeldLock:
    """The lock files one run holds, renewed by a daemon thread until :meth:`release`."""

    def __init__(self, paths: Sequence[Path], info: LockInfo, renew_seconds: float) -> None:
        self.paths, self.info = list(paths), info
        self._lost: set[Path] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, args=(renew_seconds,), daemon=True,
                                        name=f"run-lock-lease-{info.token[:8]}")
        self._thread.start()

    def _renew_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self.renew()

    def renew(self) -> None:
        """Set each held lock's modification time to now (the file server's clock); a lock that
        another run has taken over is left alone, with an error in the log."""
        for path in self.paths:
            current = read_lock(path)
            if current is None or current.token != self.info.token:
                if path not in self._lost:
                    self._lost.add(path)
                    logger.error("this run lost its lock %s (%s): its lease ran out and another run may "
                                 "now write the same outputs", path,
                                 f"now held by {current.describe()}" if current else "the file is gone")
                continue
            try:
                os.utime(path)
            except OSError as error:  # a shared filesystem's hiccup: the next turn tries again
                logger.warning("could not renew the lock %s: %s", path, error)

    def release(self) -> None:
        """Stop renewing and remove the locks this run still holds."""
        self._stop.set()
        self._thread.join(timeout=10)
        for path in reversed(self.paths):
            _remove_own(path, self.info)


def acquire(data_root: str | Path, pipeline: str, env: str, cells: Sequence[str] = (), *,
            lease_seconds: float | None = None, renew_seconds: float | None = None) -> HeldLock:
    """Take ``data_root`` whole (no ``cells``) or the given cells of it for this process; raise
    :class:`DataRootBusy` naming the holder when a live run is in the way."""
    root = Path(data_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    info = LockInfo(pid=pid, host=hostname(), pipeline=pipeline, env=env,
                    started=datetime.now().astimezone().isoformat(timespec="seconds"), token=uuid.uuid4().hex,
                    process_start=_process_start(pid), cells=tuple(sorted(set(cells))),
                    lease_seconds=LEASE_SECONDS if lease_seconds is None else float(lease_seconds))
    taken: list[Path] = []
    try:
        if info.cells:
            (root / CELLS_DIR).mkdir(exist_ok=True)
            for cell in info.cells:
                path = cell_lock_path(root, cell)
                _take(path, info, f"cell {cell} of data root {root} is in use by another kedro run")
                taken.append(path)
            _wait_for_none(root / LOCK_NAME, f"data root {root} is held whole by another kedro run", info,
                           "cells run beside each other, not beside a run that writes the shared outputs "
                           "(the comparison's shared part or report, the default chain); wait for it to end")
        else:
            path = root / LOCK_NAME
            _take(path, info, f"data root {root} is in use by another kedro run")
            taken.append(path)
            for cell_lock in sorted((root / CELLS_DIR).glob("*.lock")):
                _wait_for_none(cell_lock, f"data root {root} has a cell running", info,
                               "a run that writes the shared outputs waits for every cell; wait for the cell "
                               "to end")
    except BaseException:
        for path in reversed(taken):
            _remove_own(path, info)
        raise
    return HeldLock(taken, info, RENEW_SECONDS if renew_seconds is None else float(renew_seconds))


def check_hold(data_root: str | Path, token: str) -> LockInfo:
    """The root lock of ``data_root`` when it holds ``token`` (a grid driver's hold, under which its
    jobs run); raise :class:`DataRootBusy` when it does not (the grid ended, or lost the root)."""
    path = root_lock_path(data_root)
    holder = read_lock(path)
    if holder is not None and holder.token == token:
        return holder
    now = f"it is held by another run ({holder.describe()})" if holder else "nothing holds it now"
    raise DataRootBusy(f"this job runs under the hold of a grid on data root {path.parent} ({HOLD_ENV}={token}), "
                       f"but {now}: the grid that started it has ended or lost the root. Run the grid again "
                       f"(python -m spader_pipeline.grid), or unset {HOLD_ENV} to run this job on its own.")


def _take(path: Path, info: LockInfo, busy: str) -> None:
    """Create the lock at ``path`` for ``info``, taking over a stale one."""
    for _ in range(10):  # each turn either takes the lock, stops, or removes one stale lock
        if _create(path, info):
            return
        _stop_if_held(path, busy, info, "wait for it to end, or run this one on another root "
                                        "(conf/<env>/globals.yml: data_root)")
    raise DataRootBusy(f"could not take the lock {path}: it keeps changing hands")


def _wait_for_none(path: Path, busy: str, info: LockInfo, advice: str) -> None:
    """Stop if a live run holds the lock at ``path``; remove it if stale."""
    for _ in range(10):
        if not path.exists():
            return
        _stop_if_held(path, busy, info, advice)
    raise DataRootBusy(f"could not clear the stale lock {path}: it keeps changing hands")


def _stop_if_held(path: Path, busy: str, info: LockInfo, advice: str) -> None:
    """Raise :class:`DataRootBusy` when a live run holds ``path``; otherwise remove the stale lock."""
    holder = read_lock(path)
    try:
        renewed = path.stat().st_mtime
    except FileNotFoundError:
        return  # released meanwhile
    reason = stale_reason(holder, renewed) if holder is not None else "the lock file is unreadable"
    if reason is None:
        age = max(0.0, time.time() - renewed)
        raise DataRootBusy(
            f"{busy} ({holder.describe()}, lease renewed {age:.0f} s ago); {advice}. If that run is gone, "
            f"delete {path}, or wait: a lock not renewed for {holder.lease_seconds:.0f} s is taken over.")
    if _remove_stale(path, holder):
        logger.warning("took over the lock %s from a run that no longer holds it (%s: %s)", path,
                       holder.describe() if holder else "unknown run", reason)


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


def _remove_own(path: Path, info: LockInfo) -> None:
    """Remove the lock at ``path`` if ``info`` still holds it."""
    current = read_lock(path)
    if current is not None and current.token == info.token:
        path.unlink(missing_ok=True)
