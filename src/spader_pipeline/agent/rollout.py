"""The multi-turn search-agent rollout, independent of the engine that writes the turns.

One trajectory is::

    prompt → model turn → parse → (search → observation →)* … → answer | max turns | token budget

The loop (:func:`run_rollouts`) owns the protocol — parsing turns (:mod:`.protocol`), calling the
search backend, writing observations (one format, :func:`~.protocol.format_observation`), giving
malformed turns a corrective observation — and records every step. A *generator* writes the
assistant turns; three ship here:

* :class:`HFGenerator` (the ``hf`` engine of :mod:`.engines`) — an in-process Hugging Face causal LM,
  batched across trajectories, token level: it keeps ``prompt_ids``/``response_ids``/``response_mask``
  laid out exactly as VERL's agent loop does (observation tokens are encoded by VERL's own
  Continuous-Token builder);
* :class:`OpenAIChatGenerator` — any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM,
  SGLang, …) with bounded concurrency and retries (:mod:`.openai_backend`);
* :class:`ScriptedPolicy` — no model at all: it searches with the question's content words, then
  with the passage evidence line that best matches the question, and answers with the titles whose
  evidence line matches (:mod:`.scripted`). A real baseline and the source of warm-start
  demonstrations.

The search backend is anything with ``async search(queries, topk=..., max_chars=...) ->
SearchResponse`` (the retrieval client of :mod:`spader_pipeline.retrieval`, or
:class:`~spader_pipeline.retrieval.service.LocalSearch` around an in-process retriever).

Typical use (training or evaluation)::

    gen = build_generator("hf", model, tokenizer, SamplingParams(temperature=1.0))  # agent/engines.py
    trajectories = run_rollouts_sync(samples, gen, client, RolloutConfig(max_turns=4), template)
    t = trajectories[0]
    t.prompt_ids, t.response_ids, t.response_mask   # token layout (1 = model, 0 = observation)
    t.steps[0].queries, t.steps[0].doc_ids, t.steps[0].retrieved_texts
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from spader_pipeline.agent.prompts import render_prompt
from spader_pipeline.agent.protocol import format_error_observation, parse_turn
from spader_pipeline.agent.search_step import observe_search
from spader_pipeline.agent.types import (
    FinishReason,
    Generator,
    RolloutConfig,
    RolloutState,
    SearchBackend,
    Step,
    Trajectory,
)

logger = logging.getLogger(__name__)


__all__ = ["new_state", "run_rollouts", "run_rollouts_sync"]



def new_state(
    sample: Mapping[str, Any], template: str | None, config: RolloutConfig, system: str | None = None
) -> RolloutState:
    """A fresh trajectory for ``sample``: ``question`` rendered with ``template``, or the ready chat
    ``messages`` of the sample (e.g. VERL's ``raw_prompt``) when it has them."""
    if sample.get("messages"):
        messages = [dict(m) for m in sample["messages"]]
    else:
        if template is None:
            raise ValueError("a sample without 'messages' needs a prompt template")
        messages = render_prompt(template, str(sample["question"]), system=system)
    return RolloutState(sample=sample, messages=messages, max_response_tokens=config.max_response_tokens)


async def _observe(step: Step, search: SearchBackend, config: RolloutConfig) -> str:
    """Run the search of ``step``, fill its records, return the observation text."""
    outcome = await observe_search(search, step.queries, config)
    step.queries = outcome.queries
    step.doc_ids, step.titles, step.retrieved_texts = outcome.doc_ids, outcome.titles, outcome.retrieved_texts
    step.truncation_warning, step.error = outcome.truncation_warning, outcome.error
    step.error_kind = outcome.error_kind
    return outcome.text


async def _hook(result: Any) -> Any:
    """The result of a generator's token hook, awaited when the hook is a coroutine."""
    return await result if inspect.isawaitable(result) else result


def _finish(state: RolloutState, reason: FinishReason) -> None:
    state.finish_reason = reason


async def _advance(
    states: list[RolloutState], generator: Generator, search: SearchBackend, config: RolloutConfig
) -> None:
    """One round: every active state gets one assistant turn and, unless finished, one observation."""
    turns = await generator.generate(states)
    if len(turns) != len(states):
        raise RuntimeError(f"generator returned {len(turns)} turns for {len(states)} trajectories")
    pending: list[tuple[RolloutState, Step]] = []
    for state, turn in zip(states, turns, strict=True):
        if turn.out_of_context:
            _finish(state, "token_budget")
            continue
        if turn.error is not None:
            state.error = turn.error
            _finish(state, "error")
            continue
        start = state.response_length
        await _hook(generator.append_turn(state, turn))
        parsed = parse_turn(turn.text)
        step = Step(
            turn=len(state.steps) + 1,
            text=turn.text,
            kind=parsed.kind,
            queries=parsed.queries,
            answers=parsed.answers,
            error=parsed.error,
            error_kind="invalid_turn" if parsed.kind == "invalid" else None,
            token_span=(start, state.response_length) if generator.token_level else None,
        )
        state.steps.append(step)
        state.messages.append({"role": "assistant", "content": turn.text})
        if parsed.kind == "answer":
            state.predicted = parsed.answers
            _finish(state, "answer")
        elif len(state.steps) >= config.max_turns:
            _finish(state, "max_turns")
        elif generator.token_level and state.response_length >= config.max_response_tokens:
            _finish(state, "token_budget")
        else:
            pending.append((state, step))

    async def observe(state: RolloutState, step: Step) -> str:
        if step.kind == "search":
            return await _observe(step, search, config)
        return format_error_observation(step.error or "invalid turn")

    observations = await asyncio.gather(*(observe(s, st) for s, st in pending))
    for (state, step), text in zip(pending, observations, strict=True):
        previous = list(state.messages)
        state.messages.append({"role": "user", "content": text})
        if not await _hook(generator.append_observation(state, previous)):
            state.messages.pop()
            _finish(state, "token_budget")
            continue
        step.observation = text


async def run_rollouts(
    samples: Sequence[Mapping[str, Any]],
    generator: Generator,
    search: SearchBackend,
    config: RolloutConfig,
    template: str | None,
    *,
    system: str | None = None,
) -> list[Trajectory]:
    """Roll out one trajectory per sample, all advancing in lock-step rounds (one batch per round).

    ``samples`` are mappings with ``question`` (and usually ``id``); ``template`` is a prompt
    template with one ``{question}`` placeholder (see :mod:`.prompts`). A sample that carries
    ready ``messages`` uses them instead. Generator errors end that
    trajectory with ``finish_reason="error"``; nothing raises for a single bad sample except
    programming errors.
    """
    states = [new_state(sample, template, config, system) for sample in samples]
    for state in states:
        await _hook(generator.start(state))
    active = list(states)
    while active:
        await _advance(active, generator, search, config)
        active = [s for s in active if not s.done]
    return [_to_trajectory(s, generator.token_level) for s in states]


def run_rollouts_sync(*args: Any, **kwargs: Any) -> list[Trajectory]:
    """:func:`run_rollouts` from synchronous code (starts its own event loop)."""
    return asyncio.run(run_rollouts(*args, **kwargs))


def _to_trajectory(state: RolloutState, token_level: bool) -> Trajectory:
    return Trajectory(
        id=str(state.sample.get("id", "")),
        question=str(state.sample.get("question", "")),
        messages=state.messages,
        steps=state.steps,
        finish_reason=state.finish_reason or "error",
        predicted=state.predicted,
        prompt_ids=state.token_ids[: state.prompt_length] if token_level else None,
        response_ids=state.token_ids[state.prompt_length :] if token_level else None,
        response_mask=list(state.response_mask) if token_level else None,
        response_logprobs=list(state.response_logprobs) if token_level and state.response_logprobs else None,
        error=state.error,
    )
