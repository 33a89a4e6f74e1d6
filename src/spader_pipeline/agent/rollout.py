"""The multi-turn search-agent rollout, independent of the engine that writes the turns.

One trajectory is::

    prompt → model turn → parse → (search → observation →)* … → answer | max turns | token budget

The loop (:func:`run_rollouts`) owns the protocol — parsing turns (:mod:`.protocol`), calling the
search backend, writing observations (one format, :func:`~.protocol.format_observation`), giving
malformed turns a corrective observation — and records every step. A *generator* writes the
assistant turns; three ship here:

* :class:`HFGenerator` — an in-process Hugging Face causal LM, batched across trajectories,
  token level: it keeps ``prompt_ids``/``response_ids``/``response_mask`` laid out exactly as
  VERL's agent loop does (observation tokens are encoded by VERL's own Continuous-Token builder);
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

    gen = HFGenerator(model, tokenizer, SamplingParams(temperature=1.0))
    trajectories = run_rollouts_sync(samples, gen, client, RolloutConfig(max_turns=4), template)
    t = trajectories[0]
    t.prompt_ids, t.response_ids, t.response_mask   # token layout (1 = model, 0 = observation)
    t.steps[0].queries, t.steps[0].doc_ids, t.steps[0].retrieved_texts
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from spader_pipeline.agent.prompts import render_prompt
from spader_pipeline.agent.protocol import (
    ParsedTurn,
    format_error_observation,
    format_observation,
    parse_turn,
)
from spader_pipeline.retrieval.schemas import QueryResult, SearchResponse
from spader_pipeline.typed_config import from_mapping

logger = logging.getLogger(__name__)

FinishReason = Literal["answer", "max_turns", "token_budget", "error"]
#: Why a step's action failed: a malformed turn, a tool call without a query, queries the search
#: service refused (4xx: the agent's error), or the search service itself failing (an outage).
ErrorKind = Literal["invalid_turn", "no_query", "query_rejected", "search_failed"]

__all__ = [
    "ErrorKind",
    "FinishReason",
    "GeneratedTurn",
    "Generator",
    "RolloutConfig",
    "RolloutState",
    "SamplingParams",
    "SearchBackend",
    "SearchOutcome",
    "Step",
    "Trajectory",
    "document_text",
    "observe_search",
    "run_rollouts",
    "run_rollouts_sync",
]


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters shared by all model backends (``temperature == 0`` means greedy)."""

    temperature: float = 1.0
    """softmax temperature; 0 selects greedy decoding"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    top_k: int = -1
    """top-k sampling (-1 or 0: off)"""
    max_new_tokens: int = 512
    """most tokens one assistant turn may generate (also capped by the remaining token budget)"""
    seed: int | None = None
    """seed for sampling (in-process backend; passed through to OpenAI-compatible servers)"""

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | None) -> SamplingParams:
        return from_mapping(cls, params, where="sampling")


@dataclass(frozen=True)
class RolloutConfig:
    """Limits of one trajectory and how searches are issued.

    The token budget follows VERL's agent loop: ``max_response_tokens`` bounds the whole response
    (model turns *and* observation tokens); an observation that would overflow it ends the
    trajectory without being appended. Backends without token ids ignore it.
    """

    max_turns: int = 8
    """most assistant turns (a tool call in the last allowed turn is not executed)"""
    max_response_tokens: int = 4096
    """token budget of the whole response (token-level backends only)"""
    topk: int = 5
    """documents per query"""
    max_chars: int | None = 10000
    """retrieval budget per call, enforced by the server with its dynamic top-k (None: server default)"""
    max_observation_chars: int | None = 11000
    """client-side cap on the observation body (head kept; None: no cap)"""
    max_document_chars: int | None = None
    """each retrieved passage's text is cut to this many characters (at a word boundary) before it
    is shown, and rewards count only what was shown (None: whole passages). Short passages keep
    contexts short (CPU training); the first sentence (the evidence line) stays visible"""
    max_queries_per_call: int = 16
    """queries beyond this in one tool call are dropped (the observation says so)"""

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | None) -> RolloutConfig:
        return from_mapping(cls, params, where="rollout")


# --------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One assistant turn and what the environment did with it.

    ``doc_ids``/``titles`` are per query (outer list in query order); ``retrieved_texts`` is flat,
    one ``"title\\ncontents"`` string per retrieved document — the only text discovery rewards may
    look at (never the model's own queries). ``token_span`` is the ``[start, end)`` range of this
    turn's model tokens inside ``response_ids`` (token-level backends).
    """

    turn: int
    text: str
    kind: str
    queries: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    error: str | None = None
    error_kind: ErrorKind | None = None
    """what kind of failure ``error`` describes (``search_failed``: the service, not the agent)"""
    doc_ids: list[list[str]] = field(default_factory=list)
    titles: list[list[str]] = field(default_factory=list)
    retrieved_texts: list[str] = field(default_factory=list)
    observation: str | None = None
    truncation_warning: str | None = None
    token_span: tuple[int, int] | None = None

    @property
    def parsed(self) -> ParsedTurn:
        return ParsedTurn(kind=self.kind, queries=self.queries, answers=self.answers, error=self.error)  # type: ignore[arg-type]


@dataclass
class Trajectory:
    """A finished rollout. ``predicted`` is ``None`` when the agent never gave a valid answer."""

    id: str
    question: str
    messages: list[dict[str, str]]
    steps: list[Step]
    finish_reason: FinishReason
    predicted: tuple[str, ...] | None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    response_mask: list[int] | None = None
    response_logprobs: list[float] | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        """Assistant turns taken."""
        return len(self.steps)

    @property
    def num_searches(self) -> int:
        """Tool calls actually executed (corrective observations and the prompt's example excluded)."""
        return sum(1 for s in self.steps if s.kind == "search" and s.doc_ids)

    @property
    def num_queries(self) -> int:
        return sum(len(s.queries) for s in self.steps if s.kind == "search" and s.doc_ids)

    @property
    def num_invalid_turns(self) -> int:
        return sum(1 for s in self.steps if s.kind == "invalid")

    @property
    def retrieved_texts(self) -> list[str]:
        return [t for s in self.steps for t in s.retrieved_texts]

    def entities_found(self, ground_truth: Sequence[Sequence[str]]) -> list[tuple[int, ...]]:
        """Per step, the gold entities (normalised order) whose alias occurs in that step's retrieved
        documents (alias-aware, whole words; ``algorithms.matching.EntityMatcher``)."""
        from spader_pipeline.algorithms.matching import EntityMatcher

        matcher = EntityMatcher(ground_truth)
        found = []
        for step in self.steps:
            hits = matcher.found_in(step.retrieved_texts).any(axis=0) if step.retrieved_texts else ()
            found.append(tuple(int(i) for i, hit in enumerate(hits) if hit))
        return found

    def to_record(self) -> dict[str, Any]:
        """JSON-serialisable form (token ids included when present)."""
        record = asdict(self)
        record["predicted"] = list(self.predicted) if self.predicted is not None else None
        return record


# --------------------------------------------------------------------------------------------------
# Interfaces
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class SearchBackend(Protocol):
    """What the loop needs from retrieval (contract C: ``RetrievalClient`` satisfies it): one typed
    :class:`~spader_pipeline.retrieval.schemas.SearchResponse` per call, whatever the backend."""

    async def search(
        self, queries: Sequence[str], topk: int = 5, max_chars: int | None = None
    ) -> SearchResponse: ...


@dataclass
class RolloutState:
    """The mutable state of one trajectory while it is being rolled out.

    Generators read ``messages`` (and ``steps``, for the scripted policy) and, when token level,
    own ``token_ids`` (prompt + response so far), ``prompt_length`` and ``response_mask``.
    """

    sample: Mapping[str, Any]
    messages: list[dict[str, str]]
    steps: list[Step] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_length: int = 0
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    predicted: tuple[str, ...] | None = None
    error: str | None = None
    max_response_tokens: int = 4096
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """unique per trajectory (generators may key caches on it)"""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length


@dataclass(frozen=True)
class GeneratedTurn:
    """One assistant turn: its text, and for token-level backends the generated ids.

    ``error`` marks a failed generation (the trajectory ends with ``finish_reason="error"`` and
    the caller may retry the sample); ``out_of_context`` marks a context that no longer fits the
    model (the trajectory ends with ``"token_budget"``, scored on what it has).
    """

    text: str
    token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    error: str | None = None
    out_of_context: bool = False


class Generator:
    """Base class of turn generators. Token-level generators override the three token hooks.

    A hook may also be a coroutine (``async def``): the VERL agent loop runs its tokenizer work in
    a thread pool that way, keeping the worker's event loop free, as verl's own loops do.
    """

    token_level: bool = False

    def start(self, state: RolloutState) -> None:
        """Prepare a new trajectory (token level: encode the prompt)."""

    async def generate(self, states: Sequence[RolloutState]) -> list[GeneratedTurn]:
        """Write the next assistant turn of every state (same order)."""
        raise NotImplementedError

    def append_turn(self, state: RolloutState, turn: GeneratedTurn) -> None:
        """Record the model tokens of ``turn`` (token level)."""

    def append_observation(self, state: RolloutState, previous: list[dict[str, str]]) -> bool:
        """Encode the messages added since ``previous``; return False if they do not fit the budget."""
        return True

    async def aclose(self) -> None:
        """Release resources (HTTP clients, servers)."""


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def document_text(document: Any) -> str:
    """``"title\\ncontents"`` of a retrieved document (object or mapping)."""
    get = document.get if isinstance(document, Mapping) else lambda k, d="": getattr(document, k, d)
    title, contents = get("title", "") or "", get("contents", "") or ""
    return f"{title}\n{contents}" if title else str(contents)


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


@dataclass
class SearchOutcome:
    """What one executed tool call produced: the observation text and the per-query records."""

    text: str
    queries: tuple[str, ...]
    doc_ids: list[list[str]] = field(default_factory=list)
    titles: list[list[str]] = field(default_factory=list)
    retrieved_texts: list[str] = field(default_factory=list)
    truncation_warning: str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None


async def observe_search(
    search: SearchBackend, queries: Sequence[str], config: RolloutConfig
) -> SearchOutcome:
    """Run one tool call and render its observation. Never raises: a failed search is an observation.

    Shared by the rollout loop and the VERL search tool, so both show the model the same text.
    """
    queries = list(queries)
    note = None
    if len(queries) > config.max_queries_per_call:
        note = f"Only the first {config.max_queries_per_call} of {len(queries)} queries were run."
        queries = queries[: config.max_queries_per_call]
    if not queries:
        message = "the tool call has no non-empty query"
        return SearchOutcome(format_error_observation(message), (), error=message, error_kind="no_query")
    try:
        response = await search.search(queries, topk=config.topk, max_chars=config.max_chars)
    except Exception as exc:  # noqa: BLE001 - a failed search is an observation, not a crash
        status = getattr(exc, "status", None)
        if isinstance(status, int) and 400 <= status < 500:  # the request itself was refused
            text = format_error_observation(
                f"the search service rejected these queries ({status}); change them"
            )
            return SearchOutcome(text, tuple(queries), error=f"query rejected: {exc}", error_kind="query_rejected")
        logger.warning("search failed for %r: %s", queries, exc)
        text = format_error_observation(f"the search service failed ({exc.__class__.__name__}); try again")
        return SearchOutcome(
            text, tuple(queries), error=f"search failed: {exc.__class__.__name__}: {exc}", error_kind="search_failed"
        )
    results, warning = response.results, response.truncation_warning
    if config.max_document_chars:
        results = [_shortened(result, config.max_document_chars) for result in results]
    outcome = SearchOutcome("", tuple(queries))
    for result in results:
        docs = result.documents
        outcome.doc_ids.append([d.id for d in docs])
        outcome.titles.append([d.title for d in docs])
        outcome.retrieved_texts.extend(document_text(d) for d in docs)
    outcome.truncation_warning = " ".join(x for x in (warning, note) if x) or None
    outcome.text = format_observation(
        results, outcome.truncation_warning, max_chars=config.max_observation_chars
    )
    return outcome


def _shortened(result: QueryResult, max_chars: int) -> QueryResult:
    """A query result whose documents' contents are cut to ``max_chars`` (at a word boundary, "…")."""
    documents = []
    for doc in result.documents:
        contents = doc.contents
        if len(contents) > max_chars:
            head = contents[:max_chars]
            contents = (head[: head.rfind(" ")] if " " in head[max_chars // 2 :] else head).rstrip() + " …"
        documents.append(doc.model_copy(update={"contents": contents}))
    return result.model_copy(update={"documents": documents})


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
