"""``training.verl``, typed: the cluster, data files, Hydra configs and retrieval service of a verl launch;
and :class:`MethodLaunch`, the typed settings one method's launch reads (nothing of it reads a raw
mapping)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spader_pipeline.algorithms.rewards import SpaderRewardConfig
from spader_pipeline.algorithms.validation import ValidationSettings
from spader_pipeline.retrieval.settings import RetrievalSettings, retrieval_settings
from spader_pipeline.typed_config import from_mapping

DEFAULT_CONFIG_DIR = Path("conf/base/verl")
#: ``training.verl.platform`` values (``None``: verl detects the accelerator)
PLATFORMS = (None, "cpu")


@dataclass(frozen=True)
class VerlSettings:
    """``training.verl``: cluster, data files, config and retrieval service of a VERL launch."""

    model: str | None = None
    """``spader_model`` schedule group (``qwen3_8b``, ``llama3_8b``); ``None``: from the checkpoint's model_type"""
    overrides: Sequence[str] = ()
    """extra Hydra overrides, appended last"""
    ray_address: str | None = None
    """an existing Ray cluster (``ray://host:10001`` or ``host:6379``); ``None`` starts a local one"""
    n_gpus_per_node: int = 8
    nnodes: int = 1
    project_name: str | None = None
    total_training_steps: int | None = None
    logger: Sequence[str] = ("console", "mlflow")
    """verl's trackers"""
    train_files: str | None = None
    """a parquet file verl trains on; ``None``: the node's ``verl_train`` dataset (the catalog's, so
    under ``data_root``), written to ``<run_dir>/data/train.parquet``"""
    val_files: str | None = None
    """the validation parquet; ``None``: the node's ``verl_validation`` dataset, as for ``train_files``"""
    config_dir: str = str(DEFAULT_CONFIG_DIR)
    """folder of the Hydra configs (``method.yaml``), ``agent_loops.yaml`` and ``tool_config/``"""
    timeout: float | None = None
    """seconds before the launch is stopped; ``None``: no limit"""
    log_tail_lines: int = 80
    """lines of VERL's log kept for the error message when it fails"""
    retrieval: RetrievalSettings = field(default_factory=RetrievalSettings)
    """the search tool's retrieval service (``mode: local`` is refused: the agent loop searches over HTTP)"""
    search_tool: Mapping[str, Any] = field(default_factory=dict)
    """keys of the search tool's config (``conf/base/verl/tool_config/search_tool.yaml``) set for this
    run, e.g. the native rollout's limits ``{topk: 3, max_observation_chars: 1200, max_document_chars: 120}``"""
    platform: str | None = None
    """``cpu``: verl's own workers on this machine's CPU, ``n_gpus_per_node`` trainer ranks, our decoder as
    the rollout server (:mod:`spader_pipeline.verl_plugin.cpu`; docs/training.md, "verl on a CPU");
    ``None``: verl's own platform detection (GPUs)"""

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform={self.platform!r}: use one of {[p for p in PLATFORMS if p]} or null")


def verl_settings(block: Mapping[str, Any] | VerlSettings | None) -> VerlSettings:
    """The ``training.verl`` block as :class:`VerlSettings`; unknown keys raise, naming the key's full
    path and the known ones (a misspelt or dead key never passes silently)."""
    if isinstance(block, VerlSettings):
        return block
    values = dict(block or {})
    values["retrieval"] = retrieval_settings(values.get("retrieval"), where="training.verl.retrieval")
    return from_mapping(VerlSettings, values, where="training.verl", check_types=True)


@dataclass(frozen=True)
class MethodLaunch:
    """What one method's verl launch reads, typed once
    (:meth:`spader_pipeline.training.TrainingSettings.verl_launch`): the same method, reward settings
    and options the native trainer's configuration holds, the shared validation schedule, the launch."""

    method: str
    """a registered method (:mod:`spader_pipeline.algorithms.methods`): verl's ``spader_method``, the one
    key that selects both its estimator and its reward layout"""
    reward: SpaderRewardConfig
    """the method's reward settings over ``training.reward`` (``reward.reward_kwargs``)"""
    options: Any
    """the method's options dataclass (where its estimator reads them)"""
    validation: ValidationSettings
    """``training.validation``"""
    verl: VerlSettings = field(default_factory=VerlSettings)
    """``training.verl``"""
