"""A real ``mlflow server`` on 127.0.0.1 that a test stops and starts again on the same port (an outage).

Shared by the tracking-outage tests (a uniquely named helper module, not conftest). The outage lasts
at least ``SPADER_TEST_OUTAGE_SECONDS`` (default 4 s): longer than the MLflow client's own retry budget,
which :func:`short_client_retries` cuts to one attempt, so the outage is one the client alone would not
survive.
The writer under test does not depend on the duration (docs/reliability.md); a longer value, e.g. 300,
reproduces issue 34's five-minute redeploy.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from spader_pipeline import tracking
from spader_pipeline.local_servers import free_port

OUTAGE_SECONDS = float(os.environ.get("SPADER_TEST_OUTAGE_SECONDS", "4"))


@contextlib.contextmanager
def short_client_retries():
    """Inside: the MLflow client gives up after one attempt (its defaults retry for minutes), so a
    stopped server fails every request at once. Setup and checks outside run with the defaults."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="10")
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


class StoppableServer:
    """``mlflow server`` over a SQLite store in ``root``; :meth:`stop` and :meth:`start` at will."""

    def __init__(self, root: Path) -> None:
        self.store = f"sqlite:///{root / 'mlflow.db'}"
        self.artifacts = root / "artifacts"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stack: contextlib.ExitStack | None = None
        self.stopped_at: float | None = None

    def start(self) -> None:
        """Start (again), after at least :data:`OUTAGE_SECONDS` since :meth:`stop`."""
        if self.stopped_at is not None:
            time.sleep(max(0.0, self.stopped_at + OUTAGE_SECONDS - time.monotonic()))
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(tracking.running_ui(self.store, self.artifacts, port=self.port))
        self.stopped_at = None

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
            self.stopped_at = time.monotonic()

    def __enter__(self) -> StoppableServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
