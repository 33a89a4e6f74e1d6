"""verl's metrics on their way to the method's MLflow run: files, not calls to the server.

verl's MLflow tracker logs each step synchronously (a down server blocks it, then drops the step):
with a run to log into, verl's ``file`` tracker and our plugin's step metrics write local JSON lines
instead (:func:`metrics_to_files`), and :func:`following` ships their lines from the Kedro process
through a buffered writer while the launch runs (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spader_pipeline.tracking.buffer import active_run_writer
from spader_pipeline.tracking.metrics_files import METRICS_PATH_ENV, follow_jsonl


def metrics_to_files(params: dict[str, Any], env: dict[str, str], run_dir: Path) -> list[Path]:
    """verl's MLflow tracker logs each step synchronously (a down server blocks it, then drops the
    step): with a run to log into, verl's ``file`` tracker and our plugin's step metrics write local
    JSON lines instead, which :func:`following` ships through a buffered writer
    (docs/reliability.md). ``run_dir`` must be visible from the trainer's node, as for checkpoints."""
    if "mlflow" not in params["logger"]:
        return []
    params["logger"] = list(dict.fromkeys("file" if b == "mlflow" else b for b in params["logger"]))
    files = [(run_dir / "verl_metrics.jsonl").resolve(), (run_dir / "step_metrics.jsonl").resolve()]
    env["VERL_FILE_LOGGER_PATH"], env[METRICS_PATH_ENV] = str(files[0]), str(files[1])
    return files


@contextlib.contextmanager
def following(files: Sequence[Path]) -> Iterator[None]:
    """While the body runs (the launch), send the lines appended to ``files`` to the active MLflow run.

    A previous launch's files are first kept aside (``<name>.<time>.jsonl``, for a backfill), not
    sent again. Without an active run nothing is followed.
    """
    for path in files:
        if path.exists():
            path.replace(path.with_name(f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))
    with active_run_writer() as writer, follow_jsonl(files, writer):
        yield
