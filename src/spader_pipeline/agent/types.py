"""The data of a search-agent rollout: settings, the generator and search interfaces, the records.

A generator writes assistant turns for a batch of :class:`RolloutState`; a search backend answers
tool calls; :class:`Step` and :class:`Trajectory` record what happened (docs/agent.md). The loop
that ties them together is :mod:`.rollout`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from spader_pipeline.agent.protocol import ParsedTurn
from spader_pipeline.retrieval.schemas import SearchResponse
from spader_pipeline.typed_config import from_mapping

FinishReason = Literal["answer", "max_turns", "token_budget", "error"]
#: Why a step's action failed: a malformed turn, a tool call without a query, queries the search
#: service refused (4xx: the agent's error), or the search service itself failing (an outage).
ErrorKind = Literal["invalid_turn", "no_query", "query_rejected", "search_failed"]

__all__ = [
    "CapturesStates",
    "ErrorKind",
    "FinishReason",
    "GeneratedTurn",
    "Generator",
    "RolloutConfig",
    "RolloutState",
    "SamplingParams",
    "SearchBackend",
    "Step",
    "Trajectory",
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
        documents (alias-aware, whole words; ``algorithms.entity_search.EntityMatcher``)."""
        from spader_pipeline.algorithms.entity_search import EntityMatcher

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
    """What the loop needs from retrieval (``RetrievalClient`` satisfies it, docs/retrieval.md): one typed
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
    supports_log_probs: bool = False
    """takes ``return_log_probs=True`` and then fills each turn's ``GeneratedTurn.logprobs``"""

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


@runtime_checkable
class CapturesStates(Protocol):
    """A generator that keeps, per trajectory, one decoder block's output at its tokens: the native
    trainer's boundary states (docs/training.md). It is asked for them when built
    (``capture_states_from_layer=k``, :func:`~spader_pipeline.agent.engines.build_generator`)."""

    def captured_states(self) -> list[Any]:
        """Per trajectory, in the order they were started, its
        :class:`~spader_pipeline.agent.state_capture.CapturedStates` (``None``: nothing usable)."""
        ...
