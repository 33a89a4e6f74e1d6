"""Data shapes of the retrieval service: documents, results and the service's limits.

The wire formats of the two published clients are documented in ``docs/retrieval.md``; the
pydantic models here are what our own code passes around.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ResponseStyle = Literal["search_r1", "spader"]


class Document(BaseModel):
    """One retrieved passage. ``score`` is the retriever's (or reranker's) score, when known."""

    model_config = ConfigDict(frozen=True)

    id: str
    title: str = ""
    contents: str
    score: float | None = None


class QueryResult(BaseModel):
    """The passages retrieved for one query, best first."""

    query: str
    documents: list[Document]


class SearchResponse(BaseModel):
    """A whole ``/retrieve`` answer as our client returns it."""

    results: list[QueryResult]
    truncation_warning: str | None = None


class ServiceSettings(BaseModel):
    """Limits and defaults of the HTTP service. Every request is bounded by these caps, so no
    request can make the server allocate without bound (memory per request is at most
    ``max_body_bytes`` of input plus ``max_queries * max(max_topk, max_initial_k)`` hits)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Bind address; loopback unless told otherwise.")
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, gt=0, description="Larger request bodies get 413.")
    max_queries: int = Field(256, gt=0, description="Most queries in one request.")
    max_query_chars: int = Field(4096, gt=0, description="Longest accepted query string.")
    max_topk: int = Field(100, gt=0, description="Largest accepted topk.")
    max_initial_k: int = Field(1000, gt=0, description="Largest accepted rerank candidate depth.")
    default_topk: int = Field(5, gt=0, description="topk when the request sends none (or 0).")
    default_initial_k: int = Field(50, gt=0, description="Candidates reranked when none is sent.")
    default_max_chars: int = Field(
        10000, description="SPADER-style budget when the request sends max_chars: null (<= 0: none)."
    )
    default_style: ResponseStyle = Field(
        "search_r1", description="Response style for requests that carry no style-specific key."
    )
    search_threads: int = Field(
        1, gt=0, description="Worker threads that run batches of searches off the event loop (BM25 in RAM is "
        "GIL-bound: 1 is fastest; raise it for memory-mapped indexes on disk or GIL-releasing backends)."
    )
    batch_max_queries: int = Field(
        256, gt=0, description="Most queries coalesced into one first-stage call (a larger request runs alone)."
    )
    batch_window_ms: float = Field(
        0.0, ge=0, description="Wait this long for more requests before starting a batch from idle (0: start "
        "once the event loop has read what already arrived; under load batches form while one runs)."
    )
    limit_concurrency: int | None = Field(
        1024, description="uvicorn: connections beyond this get 503 (which clients retry)."
    )
    log_level: str = "warning"
