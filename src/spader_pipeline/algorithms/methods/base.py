"""What every RL method is made of, the registry, and the helpers the methods share.

A :class:`Method` is a typed options dataclass, a reward layout (the batch's rewards written as
token rewards ``[B, T]``) and an advantage estimator with verl's estimator signature
``(token_level_rewards [B, T], response_mask [B, T], index [B], options, layout) -> (advantages, returns)``.
Each method is one module of this package that calls :func:`register_method`; both trainers look
methods up here by name only (docs/algorithms.md, "Adding a method").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...typed_config import from_mapping
from ..rewards import SpaderRewardConfig, outcome_reward, tool_cost_coefficient
from ..steps import StepLayout, gather_steps, place_on_anchors, segment_steps

__all__ = [
    "METHODS",
    "Method",
    "MethodRewards",
    "RewardInputs",
    "answer_score",
    "cost_coefficient",
    "default_methods",
    "estimator_names",
    "fit_steps",
    "get_method",
    "method_advantages",
    "method_names",
    "method_rewards",
    "on_register",
    "options_from_mapping",
    "outcome",
    "place_on_anchors",
    "register_method",
    "registered",
    "reward_config_from_mapping",
    "search_steps_only",
    "split_outcome_and_steps",
    "unregister_method",
]

Index = Sequence[object] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class RewardInputs:
    """Per-trajectory facts every method's reward is computed from (both trainers fill this).

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
    """per trajectory, per step, identities of the retrieved documents (methods with ``needs_step_documents``)"""
    step_thinks: Sequence[Sequence[str]] | None = None
    """per trajectory, per step, the ``<think>`` text (methods with ``needs_step_thinks``)"""

    @classmethod
    def from_steps(
        cls,
        *,
        f1: Sequence[float],
        exact_match: Sequence[float],
        format_ok: Sequence[bool],
        num_gt: Sequence[int] | torch.Tensor,
        found: Sequence[Sequence[Sequence[int]]] | torch.Tensor,
        query_counts: Sequence[Sequence[float]],
        steps: int | None = None,
        step_documents: Sequence[Sequence[Sequence[str]]] | None = None,
        step_thinks: Sequence[Sequence[str]] | None = None,
    ) -> RewardInputs:
        """The one construction, from per-trajectory values, for both trainers (the native batch from
        its trajectories, the verl reward manager from its per-sample payloads).

        ``found``: the bool ``[B, S, E]`` tensor, or per trajectory, per step, the indices of the gold
        entities that step's documents hold (``[]`` for a trajectory whose steps cannot be placed);
        ``query_counts``: per trajectory, per step, the queries executed; ``steps``: ``S`` (default:
        the tensor's, else the longest trajectory's), longer rows cut to it.
        """
        if isinstance(found, torch.Tensor):
            found_steps = found.bool()
            width = found_steps.shape[1] if steps is None else steps
        else:
            width = max((len(row) for row in found), default=0) if steps is None else steps
            entities = int(max((int(n) for n in num_gt), default=0))
            found_steps = torch.zeros((len(found), width, entities), dtype=torch.bool)
            for i, row in enumerate(found):
                for s, hits in enumerate(row[:width]):
                    if hits:
                        found_steps[i, s, list(hits)] = True
        queries = torch.zeros((len(query_counts), width), dtype=torch.float32)
        for i, row in enumerate(query_counts):
            row = list(row)[:width]
            if row:
                queries[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return cls(
            f1=torch.tensor([float(x) for x in f1], dtype=torch.float32),
            exact_match=torch.tensor([float(x) for x in exact_match], dtype=torch.float32),
            format_ok=torch.tensor([bool(x) for x in format_ok]),
            found=found_steps,
            num_gt=num_gt if isinstance(num_gt, torch.Tensor) else torch.tensor([int(n) for n in num_gt], dtype=torch.long),
            query_counts=queries,
            step_documents=step_documents,
            step_thinks=step_thinks,
        )


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


RewardFn = Callable[..., MethodRewards]
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def f1_score(options: Any, *, f1: Any, exact_match: Any) -> Any:
    """The default answer score: F1."""
    return f1


@dataclass(frozen=True)
class Method:
    """One RL method: options type, reward layout, advantage estimator, and what its rewards read."""

    name: str
    estimator: str
    """the advantage estimator's name (verl's ``algorithm.adv_estimator``)"""
    options: type
    """the options dataclass (frozen; defaults = the paper's values)"""
    rewards: RewardFn
    """``(response_mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards``"""
    advantage: AdvantageFn
    """``(token_level_rewards, response_mask, index, options, layout) -> (advantages, returns)``"""
    paper: str
    exploration: bool = False
    """pays SPADER's exploration reward (``SpaderRewardConfig.enable_exploration``)"""
    tool_round_cost: float = 0.0
    """default tool cost per query when the config sets none"""
    answer_score: Callable[..., Any] = f1_score
    """``(options, *, f1, exact_match) -> score`` the outcome is built on (floats or tensors)"""
    needs_step_documents: bool = False
    """the rewards read :attr:`RewardInputs.step_documents`"""
    needs_step_thinks: bool = False
    """the rewards read :attr:`RewardInputs.step_thinks`"""
    default_run: bool = False
    """trained, evaluated and reported by the default chain (``make run``: GRPO vs SPADER)"""


METHODS: dict[str, Method] = {}
_LISTENERS: list[Callable[[Method], None]] = []


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (duplicate names are an error) and tell the listeners."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    METHODS[method.name] = method
    for listener in _LISTENERS:
        listener(method)
    return method


def unregister_method(name: str) -> None:
    """Remove the method called ``name`` (a no-op if it is not registered)."""
    METHODS.pop(name, None)


@contextmanager
def registered(method: Method) -> Iterator[Method]:
    """``method`` registered for the duration of a ``with`` block (tests, experiments)."""
    register_method(method)
    try:
        yield method
    finally:
        unregister_method(method.name)


def on_register(listener: Callable[[Method], None]) -> None:
    """Call ``listener`` for every registered method, now and whenever one is registered later
    (the verl plugin registers each method's estimator this way)."""
    _LISTENERS.append(listener)
    for method in list(METHODS.values()):
        listener(method)


def get_method(name: str) -> Method:
    """The registered method called ``name``; the error lists the available ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {sorted(METHODS)}") from None


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def default_methods() -> tuple[str, ...]:
    """The methods of the default chain (:attr:`Method.default_run`), in registration order."""
    return tuple(name for name, method in METHODS.items() if method.default_run)


def estimator_names() -> tuple[str, ...]:
    """The advantage estimators of the registered methods (verl's ``algorithm.adv_estimator``)."""
    return tuple(dict.fromkeys(method.estimator for method in METHODS.values()))


def options_from_mapping(method: str, params: Mapping[str, Any] | None) -> Any:
    """The method's typed options from a mapping (unknown keys are an error)."""
    spec = get_method(method)
    return from_mapping(spec.options, params, where=f"{method} options")


def reward_config_from_mapping(method: str, params: Mapping[str, Any] | None) -> SpaderRewardConfig:
    """The reward config of ``method``: ``enable_exploration`` is the method's, not a setting, and
    ``tool_round_cost`` defaults to the method's own."""
    spec = get_method(method)
    params = {"tool_round_cost": spec.tool_round_cost, **dict(params or {})}
    return from_mapping(SpaderRewardConfig, params, where="reward", enable_exploration=spec.exploration)


def answer_score(method: str, options: Any, *, f1: Any, exact_match: Any) -> Any:
    """The answer score ``method``'s outcome is built on (its :attr:`Method.answer_score`)."""
    return get_method(method).answer_score(options, f1=f1, exact_match=exact_match)


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
    """Token rewards ``[B, T]`` of ``method`` for a batch (docs/algorithms.md has each layout)."""
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
# Helpers the reward layouts and estimators share
# ---------------------------------------------------------------------------------------------


def cost_coefficient(global_step: int, reward: SpaderRewardConfig) -> float:
    """The tool cost ``c_eff`` at ``global_step`` (SPADER's warm-up schedule)."""
    return tool_cost_coefficient(
        global_step, cost=reward.tool_round_cost, free_steps=reward.cost_free_steps, rampup_steps=reward.cost_rampup_steps
    )


def outcome(score: torch.Tensor, inputs: RewardInputs, reward: SpaderRewardConfig, c_eff: float) -> torch.Tensor:
    """``[B]`` the outcome term on ``score`` with the trajectory's tool cost ``c_eff·ΣCount/|GT|``
    (:func:`~spader_pipeline.algorithms.rewards.outcome_reward`)."""
    return outcome_reward(
        score, inputs.format_ok, reward, cost_coefficient=c_eff, num_gt=inputs.num_gt, query_counts=inputs.query_counts
    )


def search_steps_only(values: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """Zero ``values [B, S, ...]`` on the answer step and beyond (the last run is the answer)."""
    width = values.shape[1]
    before_answer = torch.arange(width).unsqueeze(0) < (layout.num_steps - 1).unsqueeze(1)
    shape = before_answer.shape + (1,) * (values.dim() - 2)
    if values.dtype == torch.bool:
        return values & before_answer.view(shape)
    return values * before_answer.view(shape).to(values.dtype)


def fit_steps(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pad or cut the step axis (dim 1) of ``values`` to ``width``."""
    if values.shape[1] >= width:
        return values[:, :width]
    pad = torch.zeros((values.shape[0], width - values.shape[1], *values.shape[2:]), dtype=values.dtype)
    return torch.cat([values, pad], dim=1)


def split_outcome_and_steps(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, layout: StepLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor, StepLayout]:
    """Read a layout written by :func:`place_on_anchors` back: ``outcome [B]`` (the answer step's
    anchor), ``step_values [B, S]`` with the answer step zeroed, and the layout."""
    layout = layout if layout is not None else segment_steps(response_mask)
    steps = gather_steps(token_level_rewards.float(), layout)
    if layout.max_steps == 0:
        return token_level_rewards.new_zeros(token_level_rewards.shape[0]).float(), steps, layout
    last = (layout.num_steps - 1).clamp(min=0)
    answer = steps.gather(1, last.unsqueeze(1)).squeeze(1) * (layout.num_steps > 0)
    return answer, steps.scatter(1, last.unsqueeze(1), 0.0), layout
