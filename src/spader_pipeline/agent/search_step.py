"""One tool call of the agent: run the queries on the search backend and render the observation.

Shared by the rollout loop (:mod:`.rollout`) and the verl search tool, so training, evaluation and
verl show the model the same text; a failed search becomes an error observation, never a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spader_pipeline.agent.protocol import format_error_observation, format_observation
from spader_pipeline.agent.types import ErrorKind, RolloutConfig, SearchBackend
from spader_pipeline.retrieval.schemas import QueryResult

logger = logging.getLogger(__name__)

__all__ = ["SearchOutcome", "document_text", "observe_search"]


def document_text(document: Any) -> str:
    """``"title\\ncontents"`` of a retrieved document (object or mapping)."""
    get = document.get if isinstance(document, Mapping) else lambda k, d="": getattr(document, k, d)
    title, contents = get("title", "") or "", get("contents", "") or ""
    return f"{title}\n{contents}" if title else str(contents)



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
    """Run one tool call and render its observation. A failed search is an observation, not a crash,
    except where the search cannot run at all: a module the local index needs is missing (``ImportError``
    propagates), and every later search would fail alike, leaving a run of error observations.

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
    except ImportError:  # a broken installation, not a failed search
        raise
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


