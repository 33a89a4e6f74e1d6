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
  ``meta_info["global_steps"]`` (the schedule of SPADER, arXiv 2606.00593; docs/algorithms.md).

Where verl calls ``assemble_rm_scores``: only on its colocated-reward path. On the default streaming
path verl writes the per-sample scalar on the last token itself, so the shared verl config installs
:class:`~spader_pipeline.verl_plugin.batch_reward.GroupRewardAgentLoopManager`, which calls this
classmethod on every generated batch (see ``docs/algorithms.md``).

The method (``reward.reward_kwargs.method``) decides the token layout, exactly as for the native
trainer: :func:`spader_pipeline.algorithms.methods.method_rewards` (see that module's table). It has
no default: the launcher's one key ``spader_method=<method>`` sets it with the method's estimator, and a
config whose ``algorithm.adv_estimator`` is not that method's stops the manager, naming both keys. The
other ``reward_kwargs`` are :class:`~spader_pipeline.algorithms.rewards.SpaderRewardConfig` fields
(plus ``require_global_step``); the method's options are read where its estimator reads them
(:func:`~.estimators.verl_options_path`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from spader_pipeline.agent.protocol import parse_turn
from spader_pipeline.algorithms.entity_search import find_entities_in_steps
from spader_pipeline.algorithms.group_metrics import (
    advantage_agreement,
    comparison_advantages,
    group_diversity,
    normalise_query,
)
from spader_pipeline.algorithms.matching import normalize_ground_truth
from spader_pipeline.algorithms.methods import (
    RewardInputs,
    answer_score,
    get_method,
    method_advantages,
    method_rewards,
    reward_config_from_mapping,
)
from spader_pipeline.algorithms.rewards import SpaderRewardConfig, outcome_reward
from spader_pipeline.algorithms.step_metrics import rollout_step_metrics
from spader_pipeline.algorithms.steps import StepLayout, segment_steps
from spader_pipeline.data.schema import ground_truth_lists
from spader_pipeline.typed_config import SettingsError

from .estimators import verl_options
from .trajectory import MASK_FIELD, TrajectoryRecord, read_trajectory

__all__ = ["PAYLOAD_KEY", "ManagerSettings", "SpaderRewardManager"]

logger = logging.getLogger(__name__)

#: reward_extra_info key carrying the per-sample JSON payload to the batch assembly.
PAYLOAD_KEY = "spader_payload"


@dataclass(frozen=True)
class ManagerSettings:
    """What the ``spader`` manager reads from the trainer config.

    ``reward.reward_kwargs`` holds ``method`` (required), the reward config's fields (one name each, as
    in ``conf/base/parameters_training.yml``) and ``require_global_step``; the method's options come
    from :func:`~.estimators.verl_options_path`, where verl hands them to the estimator too.
    """

    method: str
    reward: SpaderRewardConfig
    options: Any
    require_global_step: bool = True
    """refuse to assemble a batch without ``meta_info["global_steps"]`` when a tool cost is configured"""

    @classmethod
    def from_config(cls, config: Any) -> ManagerSettings:
        """The settings of a trainer config; one without ``reward.reward_kwargs.method``, or whose
        ``algorithm.adv_estimator`` is not that method's estimator, is a
        :class:`~spader_pipeline.typed_config.SettingsError` naming the keys."""
        reward = config.get("reward", None) if hasattr(config, "get") else None
        kwargs = dict((reward.get("reward_kwargs", None) if reward is not None else None) or {})
        if "method" not in kwargs:
            raise SettingsError("reward.reward_kwargs.method is not set: the spader reward manager has no default "
                                "method; select one with spader_method=<method> (what the launcher passes), which "
                                "sets it with the method's estimator")
        method = str(kwargs.pop("method"))
        require = bool(kwargs.pop("require_global_step", True))
        algorithm = config.get("algorithm", None) if hasattr(config, "get") else None
        estimator = algorithm.get("adv_estimator", None) if algorithm is not None else None
        expected = get_method(method).estimator
        if estimator is not None and str(estimator) != expected:
            raise SettingsError(f"algorithm.adv_estimator={estimator} and reward.reward_kwargs.method={method} disagree: "
                                f"the method {method} trains with the estimator {expected}. On verl a method is one "
                                f"key: set spader_method=<method> and neither of these two")
        return cls(method, reward_config_from_mapping(method, kwargs), verl_options(method, algorithm), require)

    def final_term(self, record: TrajectoryRecord) -> float:
        """The group-free outcome, without tool cost (what verl's streaming path writes on the last token)."""
        score = answer_score(self.method, self.options, f1=record.score.f1, exact_match=record.score.exact_match)
        final = outcome_reward(torch.tensor([float(score)], dtype=torch.float64), torch.tensor([record.format_ok]),
                               self.reward)
        return float(final[0])


def turn_action(text: str) -> tuple[str, list[str]]:
    """A model turn as ``(kind, normalised queries or answers)``, as the native trainer records it."""
    parsed = parse_turn(text)
    items = parsed.queries if parsed.kind == "search" else parsed.answers
    return parsed.kind, [normalise_query(str(x)) for x in items]


def make_payload(
    record: TrajectoryRecord, ground_truth: Sequence[Sequence[str]], settings: ManagerSettings
) -> dict:
    """JSON-serialisable per-sample facts the batch assembly needs (entity ids index the normalised GT)."""
    gt = normalize_ground_truth(ground_truth)
    # Each step's documents separately (as the native trainer passes them): a document retrieved
    # at several steps is normalised once, and no alias matches across two documents.
    steps = [list(s.documents) for s in record.steps]
    found = find_entities_in_steps([gt], [steps], len(steps))[0]
    payload = {
        "num_gt": len(gt),
        "found": [np.flatnonzero(row).tolist() for row in found],
        "queries": [s.num_queries for s in record.steps],
        "f1": record.score.f1,
        "recall": record.score.recall,
        "precision": record.score.precision,
        "exact_match": record.score.exact_match,
        "format_ok": record.format_ok,
        "final": settings.final_term(record),
        "split": record.split,
        "actions": [list(turn_action(s.text)) for s in record.steps],
        "doc_keys": [key for s in record.steps for key in s.document_keys],
    }
    method = get_method(settings.method)
    if method.needs_step_documents:
        payload["docs"] = [list(s.document_keys) for s in record.steps]
    if method.needs_step_thinks:
        payload["thinks"] = [s.think[:4000] for s in record.steps]
    return payload


@register("spader")
class SpaderRewardManager(RewardManagerBase):
    """Reward-loop manager for every registered method's rewards (see module docstring)."""

    settings: ClassVar[ManagerSettings | None] = None
    """the batch assembly's settings, set from the trainer config (:meth:`configure`) before any batch"""

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
        self.settings = ManagerSettings.from_config(config)

    @classmethod
    def init_class(cls, config, tokenizer) -> None:
        super().init_class(config, tokenizer)
        cls.configure(config)

    @classmethod
    def configure(cls, config: Any) -> None:
        """Set the class-level settings used by :meth:`assemble_rm_scores` from a full trainer config."""
        cls.settings = ManagerSettings.from_config(config)

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
        ground_truth = ground_truth_lists(item.non_tensor_batch["reward_model"]["ground_truth"])
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
            settings=cls.configured(),
        )

    @classmethod
    def configured(cls) -> ManagerSettings:
        """The class-level settings; an error when no trainer config has set them (:meth:`configure`)."""
        if cls.settings is None:
            raise RuntimeError(f"{cls.__name__}.configure(config) was not called: the batch assembly has no method")
        return cls.settings

    @classmethod
    def step_metrics(cls, data: DataProto, token_rewards: torch.Tensor) -> dict[str, float]:
        """The native trainer's rollout metrics of an assembled batch (``method_reward/*``, ``answer/*``,
        ``retrieval/*``, ``rollout/*``, ``adv/*``, ``group/*``); ``{}`` without payloads."""
        payloads = _payloads(data, [])
        if payloads is None:
            return {}
        mask = data.batch["response_mask"]
        response_tokens = data.batch["attention_mask"][:, -mask.shape[1]:].sum(dim=1)
        return mechanism_metrics_from_payloads(
            response_mask=mask, index=data.non_tensor_batch["uid"], payloads=payloads,
            token_rewards=token_rewards, global_step=data.meta_info.get("global_steps"), settings=cls.configured(),
            response_tokens=response_tokens,
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
    settings: ManagerSettings,
) -> torch.Tensor:
    """``rm_scores [B, T]`` from per-sample payloads: the method's reward layout
    (:func:`~spader_pipeline.algorithms.methods.method_rewards`, as the native trainer)."""
    inputs, layout, step = reward_inputs_from_payloads(response_mask, payloads, global_step, settings)
    out = method_rewards(
        settings.method, response_mask, index, inputs, global_step=step,
        reward=settings.reward, options=settings.options, layout=layout,
    )
    return out.token_rewards


def reward_inputs_from_payloads(
    response_mask: torch.Tensor, payloads: Sequence[Mapping[str, Any]], global_step: int | None,
    settings: ManagerSettings,
) -> tuple[RewardInputs, StepLayout, int]:
    """What the method registry's rewards read (``RewardInputs``), the step layout of ``response_mask``
    ``[B, T]`` and the global step, from the per-sample payloads."""
    bsz, _ = response_mask.shape
    if len(payloads) != bsz:
        raise ValueError(f"{len(payloads)} payloads for a batch of {bsz}")
    layout = segment_steps(response_mask)
    # Steps split from decoded text that do not match the model-token runs (e.g. a model turn that
    # forges a <tool_response> block): no step credit or cost can be placed safely on them.
    unaligned = {i for i, p in enumerate(payloads)
                 if p.get("split") == "text" and len(p["found"]) != int(layout.num_steps[i])}
    if unaligned:
        logger.warning(
            "spader reward: %d of %d samples had text-split steps not matching the mask", len(unaligned), bsz
        )
    if global_step is None:
        if settings.require_global_step and settings.reward.tool_round_cost > 0:
            raise ValueError(
                "spader reward: meta_info['global_steps'] is missing, so the tool-cost schedule cannot run "
                "(at step 0 the cost would never be charged). Use "
                "GroupRewardAgentLoopManager or pass the step; set reward_kwargs.require_global_step=false "
                "to accept step 0."
            )
        global_step = 0
    inputs = RewardInputs.from_steps(
        f1=[p["f1"] for p in payloads],
        exact_match=[p.get("exact_match", 0.0) for p in payloads],
        format_ok=[p["format_ok"] for p in payloads],
        num_gt=[p["num_gt"] for p in payloads],
        found=[[] if i in unaligned else p["found"] for i, p in enumerate(payloads)],
        query_counts=[[] if i in unaligned else p["queries"] for i, p in enumerate(payloads)],
        steps=layout.max_steps,
        step_documents=[[] if i in unaligned else [list(d) for d in p.get("docs", [])] for i, p in enumerate(payloads)],
        step_thinks=[list(p.get("thinks", [])) for p in payloads],
    )
    return inputs, layout, int(global_step)


def mechanism_metrics_from_payloads(
    *,
    response_mask: torch.Tensor,
    index: Sequence[object] | np.ndarray,
    payloads: Sequence[Mapping[str, Any]],
    token_rewards: torch.Tensor,
    global_step: int | None,
    settings: ManagerSettings,
    response_tokens: torch.Tensor | None = None,
) -> dict[str, float]:
    """The native trainer's step metrics (docs/metrics.md) for a verl batch: the rollout's
    (:func:`~spader_pipeline.algorithms.step_metrics.rollout_step_metrics`: rewards, answers, retrieval,
    trajectory shape, the method's advantages from its ``token_rewards [B, T]``), ``group/*``, and
    ``adv/*_vs_grpo`` (GRPO's advantages beside the method's, on the same batch). ``response_tokens``
    ``[B]``: each response's length (default: up to its last model token)."""
    inputs, layout, step = reward_inputs_from_payloads(response_mask, payloads, global_step, settings)
    advantages, _ = method_advantages(settings.method, token_rewards, response_mask, index, settings.options, layout)
    rewards = method_rewards(settings.method, response_mask, index, inputs, global_step=step, reward=settings.reward,
                             options=settings.options, layout=layout)
    grpo = comparison_advantages(response_mask, index, inputs, global_step=step, reward=settings.reward, layout=layout)
    actions = [[(str(kind), tuple(items)) for kind, items in p.get("actions", [])] for p in payloads]
    diversity = group_diversity(index, actions, [list(p.get("doc_keys", [])) for p in payloads],
                                inputs.found, inputs.num_gt)
    if response_tokens is None:
        positions = torch.arange(1, response_mask.shape[1] + 1)
        response_tokens = (response_mask.bool() * positions).max(dim=1).values
    rollout = rollout_step_metrics(
        returns=rewards.returns, discovery=rewards.discovery, cost_coefficient=rewards.cost_coefficient, f1=inputs.f1,
        recall=torch.tensor([float(p.get("recall", 0.0)) for p in payloads]),
        precision=torch.tensor([float(p.get("precision", 0.0)) for p in payloads]), format_ok=inputs.format_ok,
        found=inputs.found, num_gt=inputs.num_gt, num_turns=torch.tensor([len(p.get("actions", [])) for p in payloads]),
        num_searches=torch.tensor([sum(1 for q in p.get("queries", []) if q) for p in payloads]),
        response_tokens=response_tokens, response_mask=response_mask, advantages=advantages, uids=list(index),
    )
    return {**rollout, **diversity, **advantage_agreement(advantages, grpo, response_mask)}
