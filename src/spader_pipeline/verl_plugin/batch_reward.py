"""An ``AgentLoopManager`` that assembles rewards over the whole generated batch.

Stock verl 0.9 computes rule rewards per sample while rolling out (``run_single`` in the reward loop)
and writes each scalar on the sample's last token; it calls the manager's batch hook
``assemble_rm_scores`` only on its colocated-reward-model path. Group-level rewards (SPADER's
novelty weights, CalibAdv's silver documents) need the whole prompt group, and the tool-cost schedule
needs the real training step, which only the trainer's generation batch carries
(``meta_info["global_steps"]``).

Select this manager with ``actor_rollout_ref.rollout.agent.agent_loop_manager_class=
spader_pipeline.verl_plugin.batch_reward.GroupRewardAgentLoopManager`` (a verl config field, no fork).
After every ``generate_sequences`` it calls ``assemble_rm_scores`` of the configured reward manager
class on the full batch — with the input's ``uid`` and ``global_steps`` — and replaces ``rm_scores``.
Works with the legacy trainer (``trainer.use_v1=false``), whose generation batches flow through the
manager; verl's v1 trainer streams samples into TransferQueue instead.

Also, on every generated batch:

* **padding**: verl pads a validation batch to a multiple of ``rollout.agent.num_workers`` by
  appending copies of its first rows (``protocol.pad_dataproto_to_divisor``), same ``uid`` included.
  Rows beyond the first ``n`` of a ``uid`` (``n = rollout.n``, ``val_kwargs.n`` when validating)
  are those copies: they are left out of the group terms and keep verl's per-sample score (verl
  drops them after generation).
* **validation**: on a validation batch (``meta_info["validate"]``) the greedy scores per data source
  are logged as ``val/<data_source>/recall``, ``…/f1`` and ``…/searches`` at the trainer's global
  step, the native trainer's names (:mod:`spader_pipeline.algorithms.validation`); verl's own
  ``val-core/…`` and ``val-aux/…`` metrics stay as they are.
* **search health**: the retrieval service's failures (counted per trajectory by the agent loop)
  are reported as ``search/error_rate`` and ``search/calls`` in the batch's generation metrics (verl
  logs them as ``timing_s/search/...``); above ``max_error_rate`` of the search tool's config the run
  stops with :class:`SearchServiceError` instead of training on error observations.
* **start-up**: the manager checks that every Ray node registers the plugin
  (:func:`.registration.check_workers_registered`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
from omegaconf import OmegaConf
from verl import DataProto
from verl.experimental.agent_loop import AgentLoopManager
from verl.trainer.ppo.reward import resolve_reward_manager_cls
from verl.utils.ray_utils import auto_await

from spader_pipeline import tracking
from spader_pipeline.algorithms.validation import validation_metrics

from .registration import check_workers_registered
from .trajectory import SEARCH_CALLS_FIELD, SEARCH_ERRORS_FIELD

__all__ = [
    "GroupRewardAgentLoopManager",
    "SearchServiceError",
    "assemble_group_rewards",
    "check_search_health",
    "original_rows",
    "search_health",
    "validation_batch_metrics",
]

logger = logging.getLogger(__name__)

#: search-tool config key (tool_config/search_tool.yaml) and its default
MAX_ERROR_RATE_KEY, DEFAULT_MAX_ERROR_RATE = "max_error_rate", 0.5


class SearchServiceError(RuntimeError):
    """Too many searches of a batch failed: the retrieval service is down or unreachable."""


def original_rows(uid: Sequence[object], group_size: int) -> np.ndarray:
    """``bool [B]``: True for the first ``group_size`` rows of each ``uid``, False for padded copies."""
    seen: dict[object, int] = {}
    keep = np.ones(len(uid), dtype=bool)
    for i, key in enumerate(uid):
        seen[key] = seen.get(key, 0) + 1
        keep[i] = seen[key] <= group_size
    return keep


def search_health(output: DataProto, keep: np.ndarray | None = None) -> dict[str, float]:
    """``search/calls`` and ``search/error_rate`` of a generated batch (agent-loop extra fields)."""
    calls = output.non_tensor_batch.get(SEARCH_CALLS_FIELD)
    errors = output.non_tensor_batch.get(SEARCH_ERRORS_FIELD)
    if calls is None or errors is None:
        return {}
    rows = np.arange(len(output)) if keep is None else np.flatnonzero(keep)
    total = float(sum(int(calls[i] or 0) for i in rows))
    failed = float(sum(int(errors[i] or 0) for i in rows))
    return {"search/calls": total, "search/error_rate": failed / total if total else 0.0}


def assemble_group_rewards(
    reward_cls, prompts: DataProto, output: DataProto, group_size: int | None = None,
    metrics: dict[str, float] | None = None,
) -> DataProto:
    """Replace ``output.batch["rm_scores"]`` by ``reward_cls.assemble_rm_scores`` over the whole batch.

    ``prompts`` is the (repeated) generation input: it supplies ``uid`` and ``meta_info["global_steps"]``
    in the same row order as ``output``. With ``group_size`` (rollouts per prompt), rows beyond the
    first ``group_size`` of a ``uid`` — verl's padding copies — are left out of the assembly and keep
    their per-sample score. With ``metrics`` (a dict), the reward class's ``step_metrics`` of the
    assembled batch (``group/*``, ``adv/*_vs_grpo``) are added to it.
    """
    if "rm_scores" not in output.batch.keys():
        return output
    if len(prompts) != len(output):
        raise ValueError(f"prompts ({len(prompts)}) and outputs ({len(output)}) are not aligned")
    non_tensor = dict(output.non_tensor_batch)
    for key in ("uid", "reward_model", "data_source"):
        if key in prompts.non_tensor_batch and key not in non_tensor:
            non_tensor[key] = prompts.non_tensor_batch[key]
    if "uid" not in non_tensor:  # no group labels: each sample is its own group
        non_tensor["uid"] = np.arange(len(output)).astype(str).astype(object)
    meta = dict(output.meta_info)
    if "global_steps" in prompts.meta_info:
        meta["global_steps"] = prompts.meta_info["global_steps"]
    merged = DataProto(batch=output.batch, non_tensor_batch=non_tensor, meta_info=meta)
    keep = original_rows(non_tensor["uid"], group_size) if group_size else np.ones(len(output), dtype=bool)
    if not keep.all():
        merged = merged.select_idxs(keep)
    scores = merged.batch["rm_scores"].sum(dim=-1).tolist()
    assembled = reward_cls.assemble_rm_scores(merged, scores)
    step_metrics = getattr(reward_cls, "step_metrics", None)
    if metrics is not None and step_metrics is not None:
        metrics.update(step_metrics(merged, assembled))
    if keep.all():
        output.batch["rm_scores"] = assembled
    else:
        rm_scores = output.batch["rm_scores"].clone()
        rm_scores[keep] = assembled.to(rm_scores.dtype)
        output.batch["rm_scores"] = rm_scores
    return output


class GroupRewardAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` plus a whole-batch reward assembly after each generation."""

    def __init__(self, config, *args, **kwargs):
        check_workers_registered()
        super().__init__(config, *args, **kwargs)
        self.reward_cls = resolve_reward_manager_cls(config)
        configure = getattr(self.reward_cls, "configure", None)
        if configure is not None:
            configure(config)
        self.max_error_rate = _max_error_rate(config)

    def _group_size(self, prompts: DataProto) -> int:
        rollout = self.config.actor_rollout_ref.rollout
        return int(rollout.val_kwargs.n if prompts.meta_info.get("validate", False) else rollout.n)

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        output = await super().generate_sequences(prompts)
        group_size = self._group_size(prompts)
        training = not prompts.meta_info.get("validate", False)
        metrics: dict[str, float] | None = {} if training else None
        output = assemble_group_rewards(self.reward_cls, prompts, output, group_size, metrics)
        if metrics:
            log_step_metrics(metrics, prompts.meta_info.get("global_steps"))
        if not training:
            log_step_metrics(validation_batch_metrics(prompts, output, group_size), prompts.meta_info.get("global_steps"))
        uid = prompts.non_tensor_batch.get("uid")
        health = search_health(output, original_rows(uid, group_size) if uid is not None else None)
        if health:
            output.meta_info.setdefault("timing", {}).update(health)
            check_search_health(health, self.max_error_rate)
        return output


def validation_batch_metrics(prompts: DataProto, output: DataProto, group_size: int) -> dict[str, float]:
    """``val/<data_source>/{recall,f1,searches}`` of a validation batch, verl's padding copies left out
    (the reward manager's per-sample ``recall``, ``f1`` and ``num_searches`` fields)."""
    fields = output.non_tensor_batch
    if not all(key in fields for key in ("recall", "f1", "num_searches")):
        return {}
    uid = prompts.non_tensor_batch.get("uid")
    keep = original_rows(uid, group_size) if uid is not None else np.ones(len(output), dtype=bool)
    sources = prompts.non_tensor_batch.get("data_source", np.array(["unknown"] * len(output), dtype=object))
    rows = np.flatnonzero(keep)
    return validation_metrics([str(sources[i]) for i in rows], [float(fields["recall"][i]) for i in rows],
                              [float(fields["f1"][i]) for i in rows], [float(fields["num_searches"][i]) for i in rows])


def log_step_metrics(metrics: dict[str, float], step: int | None) -> None:
    """Log the mechanism metrics of a training step to the run's MLflow run, under the native trainer's
    names (docs/metrics.md): the run verl's own MLflow logger writes into (``MLFLOW_RUN_ID`` and
    ``MLFLOW_TRACKING_URI``, which the launcher hands to verl, else the active run). verl's trainer only forwards a generation
    batch's ``timing`` to its logger, which would file them as ``timing_s/…``; without an MLflow run
    they are logged at debug level only. Under the launcher they are appended to the file
    ``SPADER_METRICS_PATH`` names, which it sends on without ever blocking this process
    (:mod:`spader_pipeline.tracking.metrics_files`)."""
    from spader_pipeline.tracking.metrics_files import METRICS_PATH_ENV, append_metrics_line

    if os.environ.get(METRICS_PATH_ENV):  # the launcher ships this file through a buffered writer
        append_metrics_line(os.environ[METRICS_PATH_ENV], metrics, step)
        return
    run_id, uri = tracking.handed_over_run()
    if not run_id:
        logger.debug("step %s mechanism metrics (no MLflow run): %s", step, metrics)
        return
    tracking.log_metrics_to_run(run_id, metrics, step, tracking_uri=uri)  # warns, never raises


def check_search_health(health: dict[str, float], max_error_rate: float) -> None:
    """Raise :class:`SearchServiceError` when more than ``max_error_rate`` of the searches failed."""
    if health.get("search/calls") and health["search/error_rate"] > max_error_rate:
        raise SearchServiceError(
            f"{health['search/error_rate']:.0%} of {health['search/calls']:.0f} searches in this batch failed "
            f"(limit {MAX_ERROR_RATE_KEY}={max_error_rate} in the search tool config): is the retrieval "
            "service reachable from every Ray node? (docs/training.md, VERL backend)"
        )


def _max_error_rate(config) -> float:
    """``max_error_rate`` of the project's search tool in ``rollout.multi_turn.tool_config_path``."""
    path = OmegaConf.select(config, "actor_rollout_ref.rollout.multi_turn.tool_config_path")
    if not path:
        return DEFAULT_MAX_ERROR_RATE
    for tool in OmegaConf.to_container(OmegaConf.load(path)).get("tools", []):
        if str(tool.get("class_name", "")).endswith("SearchTool"):
            return float((tool.get("config") or {}).get(MAX_ERROR_RATE_KEY, DEFAULT_MAX_ERROR_RATE))
    return DEFAULT_MAX_ERROR_RATE
