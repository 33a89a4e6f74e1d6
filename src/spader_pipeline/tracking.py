"""MLflow helpers shared by the Kedro hook, nodes and trainers.

Every ``kedro run`` is one MLflow run, opened by :class:`spader_pipeline.hooks.MlflowTrackingHooks`.
Code that runs inside a node logs into that run through the functions here, which are no-ops when
no run is active (plain unit tests, library use). Metric keys use ``/`` namespaces
(``data_prep/rows_in``); every key is documented in ``docs/metrics.md``.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
DEFAULT_ARTIFACT_DIR = "mlruns/artifacts"


def resolve_tracking_uri(uri: str | None, project_path: Path) -> str:
    """Return an absolute tracking URI.

    ``MLFLOW_TRACKING_URI`` in the environment wins over ``uri`` (the configured value); a relative
    SQLite path is made absolute against ``project_path`` so that subprocesses (e.g. VERL) that join
    the run through ``MLFLOW_RUN_ID`` write into the same store.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or uri or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        db_path = (project_path / uri[len(prefix) :]).resolve()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        uri = prefix + str(db_path)
    elif uri.startswith(prefix + "/"):
        Path(uri[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
    return uri


def git_commit(project_path: Path) -> str:
    """The current git commit of the project (``"unknown"`` outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=project_path, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def flatten(mapping: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Flatten nested mappings: ``{"a": {"b": 1}}`` → ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name, sep))
        else:
            flat[name] = value
    return flat


def numeric_items(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric leaves of a (nested) mapping, keys joined with ``/``."""
    out: dict[str, float] = {}
    for key, value in flatten(mapping, prefix, sep="/").items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, int | float) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def active() -> bool:
    return mlflow.active_run() is not None


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
    """Log the numeric leaves of ``metrics`` to the active run (no-op without one)."""
    if not active():
        return
    values = numeric_items(metrics, prefix)
    if values:
        mlflow.log_metrics(values, step=step)


def log_params(params: Mapping[str, Any], prefix: str = "") -> None:
    """Log flattened parameters to the active run; values are truncated to MLflow's limit."""
    if not active():
        return
    flat = {k: str(v)[:6000] for k, v in flatten(params, prefix).items()}
    items = list(flat.items())
    for start in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        mlflow.log_params(dict(items[start : start + 100]))


def log_artifact(path: str | Path, artifact_path: str | None = None) -> None:
    """Log a file or folder as an artifact of the active run (no-op without one)."""
    if not active():
        return
    path = Path(path)
    if path.is_dir():
        mlflow.log_artifacts(str(path), artifact_path)
    elif path.exists():
        mlflow.log_artifact(str(path), artifact_path)
