"""A whole experiment in one folder, run without Kedro or MLflow: for a machine that has only torch.

A *bundle* (:mod:`.bundle`) holds what a Kedro data root prepared — the training and validation
questions, the held-out set, the retrieval index, the base model — and the run's settings, resolved
from a Kedro environment. :func:`.run.run_bundle` then warm-starts the base model, trains each method
with the native trainer, scores every policy greedy on the held-out set and writes the records, the
validation curves and a summary with bootstrap intervals. The GPU check machine (docs/gpu.md) runs it
as ``python -m spader_pipeline.portable run``; CI runs the same path on the CPU with tiny settings.
"""

from spader_pipeline.portable.bundle import BUNDLE_SETTINGS, read_settings

__all__ = ["BUNDLE_SETTINGS", "read_settings"]
