"""MLflow tracking of the project, one concern per module:

* :mod:`.store`: where the runs are stored (the tracking URI) and the project's experiment;
* :mod:`.runs`: the runs themselves — the chain run of a ``kedro run``, a method's training run, the
  runs linked to them — and what nodes, trainers and plugins log into them;
* :mod:`.provenance`: which source a run ran from (the git commit);
* :mod:`.ui`: the MLflow UI server on a store;
* :mod:`.buffer`: the writer that never blocks a training step on the server, and survives its
  outages; :mod:`.metrics_files`: the JSON-lines metric files a verl launch appends, shipped
  through that writer.

Callers import this package (``from spader_pipeline import tracking``); the names below are its
interface. They are imported on first use (PEP 562): :mod:`.buffer` and :mod:`.metrics_files`
import MLflow only when a writer is made, so a process that only appends metric lines (a verl
worker) or hands a run's id to a child does not load it. An evaluation's run is
:func:`spader_pipeline.evaluation.mlflow_runs.log_evaluation`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: each name of the interface → its module
_HOME = {
    "ADOPT_TAG": "runs",
    "BufferedMetricsWriter": "buffer",
    "CHAIN_RUN_TAG": "runs",
    "CHAIN_TAG": "runs",
    "COMPARABLE_FIRST": "runs",
    "DEFAULT_ARTIFACT_DIR": "store",
    "DEFAULT_TRACKING_URI": "store",
    "EXPERIMENT_KIND": "store",
    "EXPERIMENT_KIND_TAG": "store",
    "GRID_JOB_TAG": "runs",
    "GRID_RUN_ENV": "runs",
    "GRID_TAG": "runs",
    "HELDOUT_KEYS": "runs",
    "METHOD_DEPENDENT_PREFIX": "runs",
    "METHOD_RUN_TAG": "runs",
    "METRICS_PATH_ENV": "metrics_files",
    "active": "runs",
    "active_run_id": "runs",
    "active_run_target": "buffer",
    "active_run_writer": "buffer",
    "append_metrics_line": "metrics_files",
    "backfill": "metrics_files",
    "chain_run_name": "runs",
    "comparable_first": "runs",
    "end_unfinished_children": "runs",
    "ensure_experiment": "store",
    "flatten": "runs",
    "follow_jsonl": "metrics_files",
    "git_commit": "provenance",
    "grid_parent": "runs",
    "grid_run_name": "runs",
    "handed_over_run": "runs",
    "linked_run": "runs",
    "log_artifact": "runs",
    "log_figure": "runs",
    "log_heldout": "runs",
    "log_metrics": "runs",
    "log_metrics_to_run": "runs",
    "log_params": "runs",
    "log_text": "runs",
    "method_run": "runs",
    "model_in_store": "runs",
    "numeric_items": "runs",
    "parse_metrics_line": "metrics_files",
    "register_checkpoint": "runs",
    "resolve_tracking_uri": "store",
    "run_url": "runs",
    "run_writer": "buffer",
    "running_ui": "ui",
    "training_link_tags": "runs",
    "training_note": "runs",
    "use_experiment": "store",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
