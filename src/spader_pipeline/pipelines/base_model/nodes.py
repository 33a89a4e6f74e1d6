"""Nodes of the ``base_model`` pipeline (thin: the work is in :mod:`spader_pipeline.modeling.provide`)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from spader_pipeline.child_process import in_child_process, runs_child_processes
from spader_pipeline.modeling.provide import provide_base_model as provide


@runs_child_processes
def provide_base_model(corpus: pd.DataFrame, params: dict[str, Any], prompt: dict[str, Any]) -> dict[str, Any]:
    """The base model's manifest (:func:`spader_pipeline.modeling.provide.provide_base_model`). With
    ``subprocess`` (default) it runs in a child process: converting or building a model needs
    transformers, which the Kedro process then never imports."""
    run = in_child_process(provide, enabled=params.get("subprocess", True), name="provide_base_model")
    return run(corpus, params, prompt)
