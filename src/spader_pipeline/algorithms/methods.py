"""One definition per RL method, read by both trainers (native and verl).

A method is three things, all defined here and nowhere else:

* its **typed options** (a frozen dataclass, defaults = the paper's or released script's values);
* its **reward layout**: how the batch's rewards are written as token-level rewards ``[B, T]``;
* its **advantage estimator**, with verl's estimator signature
  ``(token_level_rewards [B, T], response_mask [B, T], index [B], options) -> (advantages, returns)``.

The native trainer (:mod:`spader_pipeline.native.batch`) calls :func:`method_rewards` and
:func:`method_advantages` directly. On verl, the ``spader`` reward manager calls the same
:func:`method_rewards`, and :mod:`spader_pipeline.verl_plugin.estimators` registers
:func:`method_advantages` under each method's ``estimator`` name (``grpo`` stays verl's own
estimator, equal to ours: ``tests/algorithms/test_methods_cross_backend.py``).

| method | reward layout (token rewards) | estimator | paper |
|---|---|---|---|
| ``grpo`` | outcome on the answer step's last token | ``grpo`` | DeepSeekMath, arXiv 2402.03300 |
| ``spader`` | exploration reward on each step's last token, outcome added on the answer step | ``spa`` | SPADER, arXiv 2606.00593 |
| ``calibadv`` | outcome on the answer step, silver-document score ``q_t`` on each search step | ``calibadv`` | CalibAdv, arXiv 2604.18235 |
| ``tspo`` | outcome (exact match) on the answer step, latent reward on the first-occurrence step | ``tspo`` | TSPO, arXiv 2601.22776 (proposal) |

The **outcome** is the shared final-answer term ``w_F·score`` (``−format_penalty`` on a format
error), with score = F1 for GRPO, SPADER and CalibAdv (CalibAdv's ``F1 × format`` is this term with
the default ``w_F = 1``, ``format_penalty = 0``) and exact match for TSPO (the Search-R1 outcome its
design builds on; ``TspoOptions.outcome`` switches to F1). The last run of model tokens is always the
answer component: CalibAdv scores and TSPO's first occurrence are looked for on the earlier steps only.

**Tool cost** is a per-method setting, ``SpaderRewardConfig.tool_round_cost`` (``conf/``: each
``train_<method>.method.reward`` block): SPADER charges ``c_eff·Count_t/|GT|`` on each step (its
paper); the other methods, which have no step rewards, charge ``c_eff·ΣCount/|GT|`` on the outcome
(the SPADER fork's GRPO reward manager did the same). Their papers have no tool cost, so their
configs set it to 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..typed_config import from_mapping
from .advantages import (
    calibadv_advantage,
    calibadv_step_scores,
    grpo_outcome_advantage,
    spa_advantage,
    tspo_advantage,
)
from .rewards import (
    SpaderRewardConfig,
    final_answer_reward,
    first_occurrence_steps,
    spader_rewards,
    tool_cost_coefficient,
)
from .steps import StepLayout, gather_steps, scatter_to_anchors, segment_steps

__all__ = [
    "CalibAdvOptions",
    "GrpoOptions",
    "METHODS",
    "Method",
    "MethodRewards",
    "RewardInputs",
    "SpaOptions",
    "TspoOptions",
    "answer_score",
    "get_method",
    "method_advantages",
    "method_names",
    "method_rewards",
    "options_from_mapping",
    "register_method",
    "reward_config_from_mapping",
    "split_outcome_and_steps",
]

Index = Sequence[object] | np.ndarray | torch.Tensor


# ---------------------------------------------------------------------------------------------
# Options (one dataclass per method; field docstrings are the documentation)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrpoOptions:
    """GRPO (DeepSeekMath, arXiv 2402.03300)."""

    norm_adv_by_std_in_grpo: bool = True
    """divide by the group std (``False``: Dr.GRPO, arXiv 2503.20783)"""


@dataclass(frozen=True)
class SpaOptions:
    """SPADER's step-wise peer advantage (arXiv 2606.00593)."""

    gamma: float = 0.9
    """step discount of the returns-to-go (0.9 in all SPADER paper configs)"""
    epsilon: float = 1e-6
    """added to the group variance before the square root"""


@dataclass(frozen=True)
class CalibAdvOptions:
    """CalibAdv (arXiv 2604.18235); defaults from its released training script."""

    silver_threshold: float = 0.7
    """outcome a format-valid rollout needs for its documents to join the group's silver set"""
    think_similarity: float = 0.5
    """word-level similarity above which a turn's reasoning repeats an earlier one (score voided)"""
    max_repeated_docs: int = 1
    """a turn repeating more than this many earlier documents is voided"""
    target_ratio: float = 1.0
    """λ of the answer rebalancing (positive answer mass = |negative| / λ)"""
    epsilon: float = 1e-6
    """GRPO's std epsilon"""
    soft_penalty: bool = True
    """soften negative advantages of search turns by ``1 − q_t``"""
    rebalance_answer: bool = True
    """rebalance positive vs negative advantages on the answer component per group"""


@dataclass(frozen=True)
class TspoOptions:
    """TSPO / FOLR (arXiv 2601.22776) — PROPOSAL design: only the abstract is public (docs/algorithms.md)."""

    latent_reward: float = 0.5
    """α of the first-occurrence latent reward (UNVERIFIED)"""
    add_turn_term: bool = True
    """in mixed groups, add the turn-level term on steps up to the first occurrence"""
    epsilon: float = 1e-6
    """GRPO's std epsilon"""
    outcome: str = "exact_match"
    """outcome score: ``exact_match`` (the design's Search-R1 outcome) or ``f1``"""

    def __post_init__(self) -> None:
        if self.outcome not in ("exact_match", "f1"):
            raise ValueError(f"tspo outcome must be 'exact_match' or 'f1', got {self.outcome!r}")
        if self.latent_reward <= 0:
            raise ValueError("tspo latent_reward must be > 0 (its position marks the first occurrence)")


# ---------------------------------------------------------------------------------------------
# What the rewards read
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardInputs:
    """Per-trajectory facts every method's reward is computed from (both backends fill this).

    Step ``t`` is the ``t``-th run of model tokens of the response (``S`` steps at most).
    """

    f1: torch.Tensor
    """float ``[B]`` final-answer F1 (0 without a valid answer)"""
    exact_match: torch.Tensor
    """float ``[B]`` final-answer exact (set) match"""
    format_ok: torch.Tensor
    """bool ``[B]`` the response ended with a well-formed answer"""
    found: torch.Tensor
    """bool ``[B, S, E]`` gold entity ``e`` in the documents retrieved by step ``s``"""
    num_gt: torch.Tensor
    """long ``[B]`` distinct gold entities"""
    query_counts: torch.Tensor
    """float ``[B, S]`` queries executed by step ``s``"""
    step_documents: Sequence[Sequence[Sequence[str]]] | None = None
    """per trajectory, per step, identities of the retrieved documents (CalibAdv)"""
    step_thinks: Sequence[Sequence[str]] | None = None
    """per trajectory, per step, the ``<think>`` text (CalibAdv's near-duplicate check)"""


@dataclass(frozen=True)
class MethodRewards:
    """Token rewards of a batch in a method's layout, plus what is logged about them."""

    token_rewards: torch.Tensor
    """float ``[B, T]``: the estimator's input (verl's ``token_level_rewards``)"""
    returns: torch.Tensor
    """float ``[B]``: each trajectory's reward (outcome + exploration − tool cost), without layout markers"""
    discovery: torch.Tensor
    """float ``[B]``: novelty-weighted discovery reward (SPADER; 0 for the other methods)"""
    cost_coefficient: float
    """the tool cost ``c_eff`` applied at this global step"""


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

RewardFn = Callable[..., MethodRewards]
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Method:
    """One RL method: options type, reward layout, advantage estimator."""

    name: str
    estimator: str
    """verl ``algorithm.adv_estimator`` name"""
    options: type
    """the options dataclass"""
    rewards: RewardFn
    """``(response_mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards``"""
    advantage: AdvantageFn
    """``(token_level_rewards, response_mask, index, options, layout) -> (advantages, returns)``"""
    exploration: bool
    """pays SPADER's exploration reward"""
    tool_round_cost: float
    """default tool cost per query (``SpaderRewardConfig.tool_round_cost``) when the config sets none"""
    verl_options_key: str
    """where verl's config holds the options (``algorithm`` or ``algorithm.<estimator>``)"""
    paper: str


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (duplicate names are an error)."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method called ``name``; the error lists the available ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {sorted(METHODS)}") from None


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def options_from_mapping(method: str, params: Mapping[str, Any] | None) -> Any:
    """The method's typed options from a mapping (unknown keys are an error)."""
    spec = get_method(method)
    return from_mapping(spec.options, params, where=f"{method} options")


def reward_config_from_mapping(method: str, params: Mapping[str, Any] | None) -> SpaderRewardConfig:
    """The reward config of ``method``: ``enable_exploration`` is the method's, not a setting, and
    ``tool_round_cost`` defaults to the method's own (SPADER 0.01, the others 0)."""
    spec = get_method(method)
    params = {"tool_round_cost": spec.tool_round_cost, **dict(params or {})}
    return from_mapping(SpaderRewardConfig, params, where="reward", enable_exploration=spec.exploration)


def answer_score(method: str, options: Any, *, f1: Any, exact_match: Any) -> Any:
    """The answer score ``method``'s outcome is built on: exact match for TSPO (unless its
    ``outcome`` option says ``f1``), F1 for the others. Works on floats and tensors alike."""
    return exact_match if method == "tspo" and options.outcome == "exact_match" else f1


def method_rewards(
    method: str,
    response_mask: torch.Tensor,
    index: Index,
    inputs: RewardInputs,
    *,
    global_step: int,
    reward: SpaderRewardConfig,
    options: Any,
    layout: StepLayout | None = None,
) -> MethodRewards:
    """Token rewards ``[B, T]`` of ``method`` for a batch (see the module table for each layout)."""
    spec = get_method(method)
    _check_options(spec, options)
    layout = layout if layout is not None else segment_steps(response_mask)
    reward = dataclasses.replace(reward, enable_exploration=spec.exploration)
    return spec.rewards(
        response_mask, index, inputs, global_step=int(global_step), reward=reward, options=options, layout=layout
    )


def method_advantages(
    method: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    options: Any,
    layout: StepLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, T]`` of ``method``, 0 off model tokens."""
    spec = get_method(method)
    _check_options(spec, options)
    layout = layout if layout is not None else segment_steps(response_mask)
    adv, ret = spec.advantage(token_level_rewards, response_mask, index, options, layout)
    mask = (response_mask != 0).to(adv.dtype)
    return adv.float() * mask, ret


def _check_options(spec: Method, options: Any) -> None:
    if not isinstance(options, spec.options):
        raise TypeError(f"method {spec.name!r} takes {spec.options.__name__}, got {type(options).__name__}")


# ---------------------------------------------------------------------------------------------
# Reward layouts
# ---------------------------------------------------------------------------------------------


def _cost_coefficient(global_step: int, reward: SpaderRewardConfig) -> float:
    return tool_cost_coefficient(
        global_step, cost=reward.tool_round_cost, free_steps=reward.cost_free_steps, rampup_steps=reward.cost_rampup_steps
    )


def _outcome(score: torch.Tensor, inputs: RewardInputs, reward: SpaderRewardConfig, c_eff: float) -> torch.Tensor:
    """``[B]`` final-answer term on ``score`` minus the trajectory's tool cost ``c_eff·ΣCount/|GT|``."""
    final = final_answer_reward(
        score, inputs.format_ok, weight=reward.final_answer_weight, format_penalty=reward.format_penalty
    )
    if c_eff == 0:
        return final
    gt = inputs.num_gt.float()
    cost = c_eff * inputs.query_counts.float().sum(dim=1) / gt.clamp(min=1)
    return final - torch.where(gt > 0, cost, torch.zeros_like(cost))


def _place(step_values: torch.Tensor, outcome: torch.Tensor, layout: StepLayout, length: int) -> torch.Tensor:
    """Step values on their anchors plus ``outcome`` on the answer step (on token 0 without steps)."""
    width = layout.max_steps
    step_values = step_values * layout.step_mask.to(step_values.dtype) if width else step_values
    if width:
        last = (layout.num_steps - 1).clamp(min=0)
        has_steps = (layout.num_steps > 0).to(outcome.dtype)
        step_values = step_values.scatter_add(1, last.unsqueeze(1), (outcome * has_steps).unsqueeze(1))
    token = scatter_to_anchors(step_values, layout, length)
    if length:
        token[:, 0] += torch.where(layout.num_steps == 0, outcome, torch.zeros_like(outcome))
    return token


def _search_steps(values: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """Zero ``values [B, S, ...]`` on the answer step and beyond (the last run is the answer)."""
    width = values.shape[1]
    before_answer = torch.arange(width).unsqueeze(0) < (layout.num_steps - 1).unsqueeze(1)
    shape = before_answer.shape + (1,) * (values.dim() - 2)
    return values * before_answer.view(shape).to(values.dtype) if values.dtype != torch.bool else values & before_answer.view(shape)


def _fit_steps(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pad or cut the step axis (dim 1) of ``values`` to ``width``."""
    if values.shape[1] >= width:
        return values[:, :width]
    pad = torch.zeros((values.shape[0], width - values.shape[1], *values.shape[2:]), dtype=values.dtype)
    return torch.cat([values, pad], dim=1)


def _grpo_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    c_eff = _cost_coefficient(global_step, reward)
    outcome = _outcome(inputs.f1, inputs, reward, c_eff)
    token = _place(torch.zeros((mask.shape[0], layout.max_steps)), outcome, layout, mask.shape[1])
    return MethodRewards(token, outcome, torch.zeros_like(outcome), c_eff)


def _spader_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    out = spader_rewards(
        mask,
        index,
        f1=inputs.f1,
        format_ok=inputs.format_ok,
        global_step=global_step,
        config=reward,
        found=inputs.found,
        num_gt=inputs.num_gt,
        query_counts=inputs.query_counts,
        layout=layout,
    )
    if out.exploration is not None:
        discovery = (out.exploration.discovery * layout.step_mask).sum(dim=1)
        c_eff = out.exploration.cost_coefficient
    else:
        discovery, c_eff = torch.zeros(mask.shape[0]), _cost_coefficient(global_step, reward)
    return MethodRewards(out.token_rewards, out.token_rewards.sum(dim=1), discovery, c_eff)


def _calibadv_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    width = layout.max_steps
    c_eff = _cost_coefficient(global_step, reward)
    outcome = _outcome(inputs.f1, inputs, reward, c_eff)
    answer_term = _outcome(inputs.f1, inputs, reward, 0.0)  # silver documents: the answer's quality, cost-free
    docs = inputs.step_documents or [[] for _ in range(mask.shape[0])]
    searches = (layout.num_steps - 1).clamp(min=0).tolist()
    scores = calibadv_step_scores(
        [[list(d) for d in list(row)[:n]] for row, n in zip(docs, searches, strict=True)],
        answer_term.tolist(),
        inputs.format_ok.tolist(),
        index,
        thinks=[list(t) for t in inputs.step_thinks] if inputs.step_thinks is not None else None,
        silver_threshold=options.silver_threshold,
        think_similarity=options.think_similarity,
        max_repeated_docs=options.max_repeated_docs,
        num_steps=width,
    )
    token = _place(scores, outcome, layout, mask.shape[1])
    return MethodRewards(token, outcome, torch.zeros_like(outcome), c_eff)


def _tspo_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    width = layout.max_steps
    c_eff = _cost_coefficient(global_step, reward)
    score = answer_score("tspo", options, f1=inputs.f1, exact_match=inputs.exact_match)
    outcome = _outcome(score.float(), inputs, reward, c_eff)
    marks = torch.zeros((mask.shape[0], width))
    if width == 0:
        return MethodRewards(_place(marks, outcome, layout, mask.shape[1]), outcome, torch.zeros_like(outcome), c_eff)
    k_star = first_occurrence_steps(_search_steps(_fit_steps(inputs.found, width), layout))
    rows = (k_star >= 0).nonzero().flatten()
    marks[rows, k_star[rows]] = options.latent_reward
    token = _place(marks, outcome, layout, mask.shape[1])
    return MethodRewards(token, outcome, torch.zeros_like(outcome), c_eff)


# ---------------------------------------------------------------------------------------------
# Advantage estimators (verl's estimator signature + typed options)
# ---------------------------------------------------------------------------------------------


def split_outcome_and_steps(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, layout: StepLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor, StepLayout]:
    """Read the calibadv/tspo layouts back: ``outcome [B]`` (the answer step's anchor),
    ``step_values [B, S]`` with the answer step zeroed, and the layout."""
    layout = layout if layout is not None else segment_steps(response_mask)
    steps = gather_steps(token_level_rewards.float(), layout)
    if layout.max_steps == 0:
        return token_level_rewards.new_zeros(token_level_rewards.shape[0]).float(), steps, layout
    last = (layout.num_steps - 1).clamp(min=0)
    outcome = steps.gather(1, last.unsqueeze(1)).squeeze(1) * (layout.num_steps > 0)
    return outcome, steps.scatter(1, last.unsqueeze(1), 0.0), layout


def _grpo_advantage(rewards, mask, index, options: GrpoOptions, layout):
    return grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=options.norm_adv_by_std_in_grpo)


def _spa_advantage(rewards, mask, index, options: SpaOptions, layout):
    return spa_advantage(rewards, mask, index, gamma=options.gamma, epsilon=options.epsilon, layout=layout)


def _calibadv_advantage(rewards, mask, index, options: CalibAdvOptions, layout):
    outcome, q, layout = split_outcome_and_steps(rewards, mask, layout)
    return calibadv_advantage(
        outcome,
        mask,
        index,
        q,
        target_ratio=options.target_ratio,
        epsilon=options.epsilon,
        soft_penalty=options.soft_penalty,
        rebalance_answer=options.rebalance_answer,
        layout=layout,
    )


def _tspo_advantage(rewards, mask, index, options: TspoOptions, layout):
    outcome, marks, layout = split_outcome_and_steps(rewards, mask, layout)
    has = (marks > 0).any(dim=1)
    k_star = torch.where(has, (marks > 0).long().argmax(dim=1), torch.full_like(has, -1, dtype=torch.long))
    return tspo_advantage(
        outcome,
        k_star,
        mask,
        index,
        latent_reward=options.latent_reward,
        add_turn_term=options.add_turn_term,
        epsilon=options.epsilon,
        layout=layout,
    )


register_method(Method(
    "grpo", "grpo", GrpoOptions, _grpo_rewards, _grpo_advantage, exploration=False, tool_round_cost=0.0,
    verl_options_key="algorithm", paper="DeepSeekMath, arXiv 2402.03300",
))
register_method(Method(
    "spader", "spa", SpaOptions, _spader_rewards, _spa_advantage, exploration=True, tool_round_cost=0.01,
    verl_options_key="algorithm.spa", paper="SPADER, arXiv 2606.00593",
))
register_method(Method(
    "calibadv", "calibadv", CalibAdvOptions, _calibadv_rewards, _calibadv_advantage, exploration=False, tool_round_cost=0.0,
    verl_options_key="algorithm.calibadv", paper="CalibAdv, arXiv 2604.18235",
))
register_method(Method(
    "tspo", "tspo", TspoOptions, _tspo_rewards, _tspo_advantage, exploration=False, tool_round_cost=0.0,
    verl_options_key="algorithm.tspo", paper="TSPO, arXiv 2601.22776 (proposal design)",
))
