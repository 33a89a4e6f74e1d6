"""The old home of the buffered MLflow writer, kept so that earlier imports still work: the writer is
:mod:`spader_pipeline.tracking.buffer`, the JSON-lines metric files
:mod:`spader_pipeline.tracking.metrics_files`. New code imports from there."""

from spader_pipeline.tracking.buffer import (
    BATCH_LIMIT,
    BufferedMetricsWriter,
    active_run_target,
    active_run_writer,
    finite_numbers,
    mlflow_key,
    run_writer,
)
from spader_pipeline.tracking.metrics_files import (
    METRICS_PATH_ENV,
    append_metrics_line,
    backfill,
    follow_jsonl,
    parse_metrics_line,
)

__all__ = [
    "BATCH_LIMIT",
    "METRICS_PATH_ENV",
    "BufferedMetricsWriter",
    "active_run_target",
    "active_run_writer",
    "append_metrics_line",
    "backfill",
    "finite_numbers",
    "follow_jsonl",
    "mlflow_key",
    "parse_metrics_line",
    "run_writer",
]
