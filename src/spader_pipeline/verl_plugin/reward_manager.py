"""The ``spader`` reward-loop reward manager for stock verl 0.9.

verl's reward loop scores one sample at a time (``run_single``) and only the classmethod
``assemble_rm_scores(data, scores)`` sees the whole batch. The manager therefore works in two halves:

* :meth:`SpaderRewardManager.run_single` (reward workers, concurrent): splits the sample into steps
  with its ``response_mask``, parses each model turn (:mod:`spader_pipeline.agent.protocol`), finds the
  gold entities in each step's *retrieved documents*, scores the final answer, and returns the
  group-free final term as ``reward_score`` plus a JSON payload in ``reward_extra_info``.
* :meth:`SpaderRewardManager.assemble_rm_scores` (driver, whole batch): rebuilds the token-level
  rewards from the payloads with the group-level terms — SPADER's novelty weights ``N(e)``, CalibAdv's
  silver documents, TSPO's first occurrence — and the tool cost scheduled by the batch's real
  ``meta_info["global_steps"]`` (reference defect 1).

Where verl calls ``assemble_rm_scores``: only on its colocated-reward path. On the default streaming
path verl writes the per-sample scalar on the last token itself, so the SPADER overlays install
:class:`~spader_pipeline.verl_plugin.batch_reward.GroupRewardAgentLoopManager`, which calls this
classmethod on every generated batch (see ``docs/algorithms.md``).

Modes (``reward.reward_kwargs.mode``) and the token layout they write:

* ``spader``: exploration reward on each step's last token, final term added on the last step;
* ``outcome``: final term on the last model token (the GRPO reward; exploration off);
* ``calibadv``: outcome on the last model token, silver-document step score ``q_t`` on each search step;
* ``tspo``: outcome on the last model token, the latent reward α on the first-occurrence step ``k*``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from spader_pipeline.algorithms.advantages import calibadv_step_scores
from spader_pipeline.algorithms.matching import EntityMatcher, normalize_ground_truth
from spader_pipeline.algorithms.rewards import SpaderRewardConfig, first_occurrence_steps, spader_rewards
from spader_pipeline.algorithms.steps import scatter_to_anchors, segment_steps

from .trajectory import MASK_FIELD, TrajectoryRecord, read_trajectory

__all__ = ["PAYLOAD_KEY", "RewardSettings", "SpaderRewardManager"]

logger = logging.getLogger(__name__)

#: reward_extra_info key carrying the per-sample JSON payload to the batch assembly.
PAYLOAD_KEY = "spader_payload"
MODES = ("spader", "outcome", "calibadv", "tspo")


@dataclass(frozen=True)
class RewardSettings:
    """``reward.reward_kwargs`` understood by the ``spader`` manager (defaults = paper / released scripts)."""

    mode: str = "spader"
    alpha: float = 1.0
    beta: float = 4.0
    lambda_val: float = 1.0
    tool_round_cost: float = 0.01
    cost_free_steps: int = 100
    cost_rampup_steps: int = 100
    final_answer_weight: float = 1.0
    format_penalty: float = 0.0
    require_global_step: bool = True
    # CalibAdv (calibadv_tspo spec §1.5, released script)
    silver_threshold: float = 0.7
    think_similarity: float = 0.5
    max_repeated_docs: int = 1
    # TSPO proposal (spec §2.2; UNVERIFIED constants)
    latent_reward: float = 0.5
    tspo_outcome: str = "exact_match"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"reward_kwargs.mode must be one of {MODES}, got {self.mode!r}")
        if self.tspo_outcome not in ("exact_match", "f1"):
            raise ValueError(
                f"reward_kwargs.tspo_outcome must be 'exact_match' or 'f1', got {self.tspo_outcome!r}"
            )
        self.reward_config()  # validates the numeric fields

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> RewardSettings:
        kwargs = dict(kwargs or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown reward_kwargs for the spader manager: {unknown}; known: {sorted(known)}"
            )
        return cls(**kwargs)

    @classmethod
    def from_config(cls, config: Any) -> RewardSettings:
        reward = config.get("reward", {}) if hasattr(config, "get") else {}
        kwargs = reward.get("reward_kwargs", None) if reward is not None else None
        if kwargs is not None and not isinstance(kwargs, Mapping):
            kwargs = dict(kwargs)
        return cls.from_kwargs(kwargs)

    def reward_config(self) -> SpaderRewardConfig:
        return SpaderRewardConfig(
            alpha=self.alpha,
            beta=self.beta,
            lam=self.lambda_val,
            tool_round_cost=self.tool_round_cost,
            cost_free_steps=self.cost_free_steps,
            cost_rampup_steps=self.cost_rampup_steps,
            final_answer_weight=self.final_answer_weight,
            format_penalty=self.format_penalty,
            enable_exploration=self.mode == "spader",
        )

    def final_term(self, record: TrajectoryRecord) -> float:
        if not record.format_ok:
            return -self.format_penalty
        return self.final_answer_weight * record.score.f1


def make_payload(
    record: TrajectoryRecord, ground_truth: Sequence[Sequence[str]], settings: RewardSettings
) -> dict:
    """JSON-serialisable per-sample facts the batch assembly needs (entity ids index the normalised GT)."""
    matcher = EntityMatcher(normalize_ground_truth(ground_truth))
    found = matcher.found_in([s.document_text for s in record.steps])
    payload = {
        "num_gt": matcher.num_entities,
        "found": [np.flatnonzero(row).tolist() for row in found],
        "queries": [s.num_queries for s in record.steps],
        "f1": record.score.f1,
        "exact_match": record.score.exact_match,
        "format_ok": record.format_ok,
        "final": settings.final_term(record),
        "split": record.split,
    }
    if settings.mode == "calibadv":
        payload["docs"] = [list(s.document_keys) for s in record.steps]
        payload["thinks"] = [s.think[:4000] for s in record.steps]
    return payload


@register("spader")
class SpaderRewardManager(RewardManagerBase):
    """Reward-loop manager for SPADER / outcome / CalibAdv / TSPO rewards (see module docstring)."""

    settings: ClassVar[RewardSettings] = RewardSettings()

    def __init__(
        self,
        config,
        tokenizer,
        compute_score=None,
        reward_router_address=None,
        reward_model_tokenizer=None,
        **_,
    ):
        super().__init__(config, tokenizer, compute_score)
        self.settings = RewardSettings.from_config(config)

    @classmethod
    def init_class(cls, config, tokenizer) -> None:
        super().init_class(config, tokenizer)
        cls.configure(config)

    @classmethod
    def configure(cls, config: Any) -> None:
        """Set the class-level settings used by :meth:`assemble_rm_scores` from a full trainer config."""
        cls.settings = RewardSettings.from_config(config)

    # ---------------------------------------------------------------- per sample

    def score_sample(self, data: DataProto) -> dict:
        """Synchronous body of :meth:`run_single` (one sample)."""
        item = data[-1]
        responses = item.batch["responses"]
        length = responses.shape[-1]
        valid = int(item.batch["attention_mask"][-length:].sum().item())
        mask = None
        if "response_mask" in item.batch.keys():
            mask = item.batch["response_mask"][:valid]
        else:
            extra = item.non_tensor_batch.get("tool_extra_fields", None)
            if isinstance(extra, Mapping) and extra.get(MASK_FIELD) is not None:
                mask = torch.as_tensor(extra[MASK_FIELD])[:valid]
        ground_truth = item.non_tensor_batch["reward_model"]["ground_truth"]
        ground_truth = ground_truth.tolist() if isinstance(ground_truth, np.ndarray) else ground_truth
        record = read_trajectory(
            responses[:valid],
            mask,
            ground_truth,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
        )
        payload = make_payload(record, ground_truth, self.settings)
        info = {
            "f1": record.score.f1,
            "precision": record.score.precision,
            "recall": record.score.recall,
            "exact_match": record.score.exact_match,
            "format_error": float(not record.format_ok),
            "num_queries": float(sum(s.num_queries for s in record.steps)),
            "num_searches": float(sum(1 for s in record.steps if s.num_queries)),
            "entities_in_documents": float(len({e for row in payload["found"] for e in row})),
            PAYLOAD_KEY: json.dumps(payload, ensure_ascii=False),
        }
        return {"reward_score": payload["final"], "reward_extra_info": info}

    async def run_single(self, data: DataProto) -> dict:
        return await self.loop.run_in_executor(None, self.score_sample, data)

    # ---------------------------------------------------------------- whole batch

    @classmethod
    def assemble_rm_scores(cls, data: DataProto, scores: list[Any]) -> torch.Tensor:
        """Token-level rewards ``[B, T]`` for the whole batch (group terms included).

        Reads per-sample payloads from ``data.non_tensor_batch["spader_payload"]`` (or from ``scores``
        entries that are payload dicts/JSON), groups by ``uid`` and takes the training step from
        ``data.meta_info["global_steps"]``. Without payloads it falls back to verl's last-token layout.
        """
        payloads = _payloads(data, scores)
        if payloads is None:
            logger.warning("spader reward: no per-sample payloads in the batch; using last-token scores only")
            return super().assemble_rm_scores(data, [float(s) for s in scores])
        return assemble_token_rewards(
            response_mask=data.batch["response_mask"],
            index=data.non_tensor_batch["uid"],
            payloads=payloads,
            global_step=data.meta_info.get("global_steps"),
            settings=cls.settings,
        )


def _payloads(data: DataProto, scores: Sequence[Any]) -> list[dict] | None:
    raw = data.non_tensor_batch.get(PAYLOAD_KEY) if data.non_tensor_batch else None
    if raw is None and scores and all(isinstance(s, (Mapping, str)) for s in scores):
        raw = scores
    if raw is None:
        return None
    return [json.loads(p) if isinstance(p, str) else dict(p) for p in raw]


def assemble_token_rewards(
    *,
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray,
    payloads: Sequence[Mapping[str, Any]],
    global_step: int | None,
    settings: RewardSettings,
) -> torch.Tensor:
    """Build ``rm_scores [B, T]`` from per-sample payloads in the layout of ``settings.mode``."""
    bsz, length = response_mask.shape
    if len(payloads) != bsz:
        raise ValueError(f"{len(payloads)} payloads for a batch of {bsz}")
    layout = segment_steps(response_mask)
    width = layout.max_steps
    ok = torch.tensor([bool(p["format_ok"]) for p in payloads])
    f1 = torch.tensor([float(p["f1"]) for p in payloads])
    n_ent = max((int(p["num_gt"]) for p in payloads), default=0)
    found = torch.zeros((bsz, width, n_ent), dtype=torch.bool)
    queries = torch.zeros((bsz, width))
    unaligned: set[int] = set()
    for i, p in enumerate(payloads):
        if p.get("split") == "text" and len(p["found"]) != int(layout.num_steps[i]):
            # Steps split from decoded text do not match the model-token runs (e.g. a model turn that
            # forges a <tool_response> block): no step credit or cost can be placed safely.
            unaligned.add(i)
            continue
        for s, ents in enumerate(p["found"][:width]):
            if ents:
                found[i, s, ents] = True
        q = p["queries"][:width]
        queries[i, : len(q)] = torch.tensor(q, dtype=torch.float32)
    num_gt = torch.tensor([int(p["num_gt"]) for p in payloads])
    if unaligned:
        logger.warning(
            "spader reward: %d of %d samples had text-split steps not matching the mask", len(unaligned), bsz
        )

    if settings.mode in ("spader", "outcome"):
        if settings.mode == "spader" and global_step is None:
            if settings.require_global_step and settings.tool_round_cost > 0:
                raise ValueError(
                    "spader reward: meta_info['global_steps'] is missing, so the tool-cost schedule cannot run "
                    "(the reference silently used step 0 and never charged the cost). Use "
                    "GroupRewardAgentLoopManager or pass the step; set reward_kwargs.require_global_step=false "
                    "to accept step 0."
                )
            global_step = 0
        out = spader_rewards(
            response_mask,
            index,
            f1=f1,
            format_ok=ok,
            global_step=int(global_step or 0),
            config=settings.reward_config(),
            found=found,
            num_gt=num_gt,
            query_counts=queries,
            layout=layout,
        )
        return out.token_rewards

    # calibadv / tspo: outcome on the last step's anchor, a marker score on search steps
    step_values = torch.zeros((bsz, width))
    last = (layout.num_steps - 1).clamp(min=0)
    if settings.mode == "calibadv":
        outcome = torch.where(ok, f1, torch.zeros_like(f1))  # CalibAdv: F1 × strict format
        docs = [
            []
            if i in unaligned
            else [list(d) for d in p.get("docs", [])][: max(int(layout.num_steps[i]) - 1, 0)]
            for i, p in enumerate(payloads)
        ]
        thinks = [list(p.get("thinks", [])) for p in payloads]
        q = calibadv_step_scores(
            docs,
            outcome.tolist(),
            ok.tolist(),
            index,
            thinks=thinks,
            silver_threshold=settings.silver_threshold,
            think_similarity=settings.think_similarity,
            max_repeated_docs=settings.max_repeated_docs,
            num_steps=width,
        )
        step_values[:, : q.shape[1]] = q[:, :width]
    else:  # tspo
        key = "exact_match" if settings.tspo_outcome == "exact_match" else "f1"
        outcome = torch.tensor([float(p[key]) if p["format_ok"] else 0.0 for p in payloads])
        searchable = found.clone()
        steps_idx = torch.arange(width).unsqueeze(0)
        searchable[(steps_idx >= last.unsqueeze(1)).unsqueeze(-1).expand_as(searchable)] = False
        k_star = first_occurrence_steps(searchable)
        rows = (k_star >= 0).nonzero().flatten()
        step_values[rows, k_star[rows]] = settings.latent_reward
    if width:
        has = layout.num_steps > 0
        step_values[has, last[has]] = outcome[has]
    return scatter_to_anchors(step_values * layout.step_mask, layout, length)
