"""JSON-lines metric files: verl's ``file`` tracker, our verl plugin's step metrics
(:data:`METRICS_PATH_ENV`) and the native trainer's ``metrics.jsonl``. :func:`follow_jsonl` ships
the lines a running launch appends through a :class:`~spader_pipeline.tracking.buffer.BufferedMetricsWriter`;
:func:`backfill` sends a finished run's file again (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from spader_pipeline.tracking.buffer import BufferedMetricsWriter

#: Environment variable naming the JSON-lines file our verl plugin appends its step metrics to.
METRICS_PATH_ENV = "SPADER_METRICS_PATH"


def parse_metrics_line(line: str) -> tuple[dict[str, Any], int] | None:
    """``(metrics, step)`` of one line: verl's ``{"step", "data"}`` or the native ``{"step", ...}``."""
    try:
        record = json.loads(line)
    except ValueError:
        return None  # a line cut by a crash mid-write
    if not isinstance(record, dict) or "step" not in record:
        return None
    data = record["data"] if isinstance(record.get("data"), dict) else {k: v for k, v in record.items() if k != "step"}
    return data, int(record["step"] or 0)


def append_metrics_line(path: str | Path, metrics: Mapping[str, Any], step: int | None) -> None:
    """Append one ``{"step", "data"}`` line (verl's file-tracker format) to ``path``."""
    line = json.dumps({"step": int(step or 0), "data": dict(metrics)}, default=float) + "\n"
    with Path(path).open("a") as f:
        f.write(line)


@contextlib.contextmanager
def follow_jsonl(paths: Sequence[str | Path], writer: BufferedMetricsWriter | None,
                 poll_seconds: float = 0.5,
                 transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Iterator[None]:
    """While the body runs (a verl launch), send each complete line appended to ``paths`` through
    ``writer`` (its metrics through ``transform`` first, when given); on exit read the files to their
    end once more. ``writer=None``: nothing happens."""
    if writer is None:
        yield
        return
    offsets = {Path(p): 0 for p in paths}
    stop = threading.Event()

    def read_new() -> None:
        for path, offset in offsets.items():
            if not path.is_file():
                continue
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits
            offsets[path] = offset + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                parsed = parse_metrics_line(line)
                if parsed:
                    metrics, step = parsed
                    writer.log_metrics(transform(metrics) if transform else metrics, step)

    def loop() -> None:
        while not stop.wait(poll_seconds):
            read_new()

    thread = threading.Thread(target=loop, name="metrics-follower", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        read_new()


def backfill(run_id: str, path: str | Path, tracking_uri: str | None = None, timeout: float | None = 600.0) -> bool:
    """Send every step of a metrics file (``metrics.jsonl``) to ``run_id`` again; ``True`` when delivered.

    For a run whose end came while the server was still down. The file holds no times, so a point
    sent twice is stored twice (at different times): backfill once, after the run.
    """
    writer = BufferedMetricsWriter(run_id, tracking_uri)
    for line in Path(path).read_text().splitlines():
        parsed = parse_metrics_line(line)
        if parsed:
            writer.log_metrics(*parsed)
    return writer.close(timeout)
