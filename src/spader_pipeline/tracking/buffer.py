"""Metrics that never wait on the tracking server, and are never lost when it is down.

:class:`BufferedMetricsWriter` takes a training step's metrics (and sample files) for one MLflow run
and returns at once; a background thread sends them in order. When the server does not answer, the
thread keeps everything and retries with a capped backoff, however long the outage lasts (the
mechanism does not depend on its duration: only memory bounds it, a few hundred bytes per step);
when the server is back it sends the backlog. :meth:`BufferedMetricsWriter.close`, at the end of the
run, waits for the backlog and warns how long tracking was down, or what could not be delivered.

verl's metrics take the same path: the launcher points verl's ``file`` tracker (and our mechanism
metrics) at local JSON-lines files, whose lines
:func:`spader_pipeline.tracking.metrics_files.follow_jsonl` ships from the Kedro process through a
writer (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: MLflow accepts at most this many metrics in one ``log_batch`` request.
BATCH_LIMIT = 1000
_NOT_IN_KEYS = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts it (verl's ``…/mean@4`` → ``…/mean_at_4``, as verl's own tracker does)."""
    return _NOT_IN_KEYS.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


def finite_numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite real numbers of a flat mapping (bools as 0/1, NumPy scalars too) under MLflow-valid keys."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            out[mlflow_key(str(key))] = float(value)
    return out


@dataclass
class _Item:
    """One queued write: a step's metrics, or a file to upload as an artifact."""

    metrics: dict[str, float] = field(default_factory=dict)
    step: int = 0
    timestamp_ms: int = 0
    artifact: Path | None = None
    artifact_path: str | None = None


class BufferedMetricsWriter:
    """Non-blocking, order-keeping, outage-surviving MLflow writer for one run.

    Args:
        run_id / tracking_uri: the run and its store (``None``: MLflow's current tracking URI).
        first_backoff / max_backoff: seconds between retries while the server is down, doubling
            from the first to the cap.
    """

    def __init__(self, run_id: str, tracking_uri: str | None = None, *, first_backoff: float = 1.0,
                 max_backoff: float = 30.0) -> None:
        import mlflow

        self.run_id = run_id
        self._client = mlflow.MlflowClient(tracking_uri)
        self._first_backoff, self._max_backoff = first_backoff, max_backoff
        self._pending: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._closed: bool | None = None
        self._down_since: float | None = None
        self.outage_seconds = 0.0
        """total time the server did not answer (closed outages, plus an open one at close)"""
        self.outages = 0
        self.delivered = 0
        self.dropped = 0
        """writes the server refused (a 4xx answer): never retried"""
        self._thread = threading.Thread(target=self._run, name=f"mlflow-writer-{run_id[:8]}", daemon=True)
        self._thread.start()

    # -- the caller's side: never blocks on the network ------------------------------------------

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Queue the finite numbers of the flat mapping ``metrics`` for ``step``, in its order."""
        values = finite_numbers(metrics)
        if values:
            self._put(_Item(values, int(step or 0), int(time.time() * 1000)))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Queue the file at ``path`` for upload (it must not change before it is sent)."""
        self._put(_Item(artifact=Path(path), artifact_path=artifact_path))

    def _put(self, item: _Item) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("BufferedMetricsWriter is closed")
            self._pending.append(item)
            self._cond.notify_all()

    @property
    def backlog(self) -> int:
        """Writes not yet delivered."""
        with self._cond:
            return len(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is delivered (or ``timeout`` seconds); ``True`` if it was."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 600.0) -> bool:
        """Deliver the backlog (waiting up to ``timeout`` seconds), stop the thread, report outages.

        Returns whether everything was delivered (none left, none refused); what was not is named in
        a warning (the run's ``metrics.jsonl`` still holds it: :func:`backfill` sends it later).
        Closing again only returns the first answer.
        """
        if self._closed is not None:
            return self._closed
        delivered = self.flush(timeout)
        with self._cond:
            self._closing = True
            left = len(self._pending)
            if self._down_since is not None:
                self.outage_seconds += time.monotonic() - self._down_since
            self._cond.notify_all()
        self._thread.join(timeout=5)
        if left:
            logger.warning("MLflow tracking of run %s unreachable for %.0f s; %d write(s) not delivered at the end "
                           "(the run's metrics files hold them: spader_pipeline.tracking.metrics_files.backfill)",
                           self.run_id, self.outage_seconds, left)
        elif self.outages:
            logger.warning("MLflow tracking of run %s was down for %.1f s in total (%d outage(s)); every buffered "
                           "metric was delivered", self.run_id, self.outage_seconds, self.outages)
        self._closed = delivered and not left and not self.dropped
        return self._closed

    def __enter__(self) -> BufferedMetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the background thread ----------------------------------------------------------------------

    def _run(self) -> None:
        backoff = self._first_backoff
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                batch = _next_batch(self._pending)
            try:
                self._send(batch)
            except Exception as exc:  # noqa: BLE001 - the server or network failed: keep and retry
                if _refused(exc):  # the server answered no (a bad key, a deleted run): retrying cannot help
                    logger.warning("MLflow refused %d write(s) for run %s, dropped: %s", len(batch), self.run_id, exc)
                    self._done(batch)
                    self.dropped += len(batch)
                    continue
                self._went_down(exc)
                resume_at = time.monotonic() + backoff
                with self._cond:  # new writes do not cut the wait short; close() does
                    while not self._closing and (left := resume_at - time.monotonic()) > 0:
                        self._cond.wait(left)
                backoff = min(backoff * 2, self._max_backoff)
                continue
            backoff = self._first_backoff
            self._done(batch, delivered=True)

    def _done(self, batch: Sequence[_Item], delivered: bool = False) -> None:
        """Take ``batch`` off the queue; a delivery ends an outage."""
        with self._cond:
            for _ in batch:
                self._pending.popleft()
            if delivered:
                self.delivered += len(batch)
                if self._down_since is not None:
                    down = time.monotonic() - self._down_since
                    self.outage_seconds += down
                    self._down_since = None
                    logger.warning("MLflow tracking is back after %.1f s; sending the buffered metrics", down)
            self._cond.notify_all()

    def _went_down(self, exc: Exception) -> None:
        with self._cond:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
                logger.warning("MLflow tracking unreachable (%s: %s); training goes on, metrics are buffered",
                               type(exc).__name__, str(exc)[:300])

    def _send(self, batch: Sequence[_Item]) -> None:
        from mlflow.entities import Metric

        if batch[0].artifact is not None:
            self._client.log_artifact(self.run_id, str(batch[0].artifact), batch[0].artifact_path)
            return
        entries = [Metric(k, v, item.timestamp_ms, item.step) for item in batch for k, v in item.metrics.items()]
        for start in range(0, len(entries), BATCH_LIMIT):
            self._client.log_batch(self.run_id, metrics=entries[start:start + BATCH_LIMIT])


def _refused(exc: Exception) -> bool:
    """Whether ``exc`` is a definite refusal (a 4xx answer, a missing local file), not an outage."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, FileNotFoundError | IsADirectoryError):
        return True
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return 400 <= status < 500 and status not in (408, 429)
    return False


def _next_batch(pending: deque[_Item]) -> list[_Item]:
    """The head of the queue: one artifact, or consecutive metric items up to :data:`BATCH_LIMIT` values.

    A resend after a failure may store a batch twice; MLflow keeps one copy of identical points.
    """
    if pending[0].artifact is not None:
        return [pending[0]]
    batch, size = [], 0
    for item in pending:
        if item.artifact is not None or (batch and size + len(item.metrics) > BATCH_LIMIT):
            break
        batch.append(item)
        size += len(item.metrics)
    return batch


@contextlib.contextmanager
def active_run_writer(**kwargs: Any) -> Iterator[BufferedMetricsWriter | None]:
    """A writer for the active MLflow run (``None`` without one), closed (flushed) on exit."""
    with run_writer(*active_run_target(), **kwargs) as writer:
        yield writer


def active_run_target() -> tuple[str | None, str | None]:
    """``(run id, tracking URI)`` of the active MLflow run, ``(None, None)`` without one: what a
    child process needs to log to it (:func:`run_writer`)."""
    import mlflow

    run = mlflow.active_run()
    return (run.info.run_id, mlflow.get_tracking_uri()) if run is not None else (None, None)


@contextlib.contextmanager
def run_writer(run_id: str | None, tracking_uri: str | None = None,
               **kwargs: Any) -> Iterator[BufferedMetricsWriter | None]:
    """A writer for the run ``run_id`` (``None`` when it is ``None``), closed (flushed) on exit."""
    if run_id is None:
        yield None
        return
    writer = BufferedMetricsWriter(run_id, tracking_uri, **kwargs)
    try:
        yield writer
    except BaseException:
        writer.close(timeout=60)  # the body failed: deliver what the server takes soon, then let it raise
        raise
    writer.close()
