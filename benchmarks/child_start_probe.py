"""The no-op target of bench_child_start.py, in a module that imports what a training child's does."""

import spader_pipeline.native.stages  # noqa: F401 - the import a training child pays for


def probe() -> None:
    return None
