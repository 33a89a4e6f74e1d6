"""Nodes of the ``merge`` pipeline."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spader_pipeline import tracking
from spader_pipeline.launch.merge import merge_fsdp_checkpoint

logger = logging.getLogger(__name__)


def merge_policy(policy_manifest: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """An HF directory for a trained policy: merged from VERL's FSDP actor, or passed through (native).

    A merged VERL checkpoint is recorded as an MLflow model of its training run (the native trainer
    records its own final folder), so evaluations link back to the run that trained it.
    """
    if policy_manifest.get("backend") != "verl":
        logger.info("%s: native checkpoint is already a Hugging Face directory", policy_manifest.get("method"))
        return {**policy_manifest, "merged": False}
    if not params.get("output_dir"):  # no project-relative default: the folder must follow data_root
        raise ValueError("merge.output_dir is not set (conf/base/parameters_merge.yml: ${globals:data_root}/06_models/merged)")
    target = Path(params["output_dir"]) / f"train_{policy_manifest['method']}"
    path = merge_fsdp_checkpoint(policy_manifest["actor_dir"], target, timeout=params.get("timeout"))
    manifest = {**policy_manifest, "path": str(path.resolve()), "merged": True}
    if policy_manifest.get("mlflow_run_id"):  # the merged folder is the training run's MLflow model
        manifest["mlflow_model_id"] = tracking.register_checkpoint(
            path, name=str(policy_manifest["method"]), run_id=policy_manifest["mlflow_run_id"])
    return manifest
