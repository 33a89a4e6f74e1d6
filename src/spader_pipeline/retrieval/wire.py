"""``POST /retrieve`` request parsing and response rendering for both published clients.

Two clients talk to the same endpoint and expect different answers:

* Search-R1 / VERL ``search_r1_like`` sends ``{"queries", "topk", "return_scores"}`` and reads
  ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (one list per query).
* SPADER's training and evaluation clients send ``{"queries", "topk", "initial_k", "max_chars"
  [, "use_reranker"]}`` and read ``{"result": [{"query", "documents": [...]}, ...],
  "truncation_warning"?}`` under a character budget.

Style detection (first rule that applies): an explicit ``"response_format": "search_r1"|"spader"``;
any SPADER-only key (``initial_k``, ``max_chars``, ``use_reranker``, even when null) → SPADER;
``return_scores`` present → Search-R1; otherwise the configured ``default_style``. The keys each
published client sends make the two cases disjoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from spader_pipeline.retrieval.budget import BudgetTooSmall, apply_budget
from spader_pipeline.retrieval.schemas import ResponseStyle, ServiceSettings

SPADER_KEYS = ("initial_k", "max_chars", "use_reranker")


class RequestError(Exception):
    """A request the service refuses; ``status`` is the HTTP status (4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Body(BaseModel):
    """Field types of a ``/retrieve`` body; unknown keys are ignored (other clients' extras)."""

    model_config = ConfigDict(extra="ignore")

    queries: list[StrictStr]
    topk: StrictInt | None = None
    return_scores: StrictBool | None = None
    initial_k: StrictInt | None = None
    max_chars: StrictInt | None = None
    use_reranker: StrictBool | None = None
    response_format: ResponseStyle | None = None


@dataclass(frozen=True)
class RetrieveRequest:
    queries: tuple[str, ...]
    topk: int
    initial_k: int
    style: ResponseStyle
    return_scores: bool
    max_chars: int | None
    use_reranker: bool | None


def detect_style(payload: dict[str, Any], default: ResponseStyle) -> ResponseStyle:
    """Which published client sent ``payload`` (see module docstring)."""
    explicit = payload.get("response_format")
    if explicit in ("search_r1", "spader"):
        return explicit
    if any(key in payload for key in SPADER_KEYS):
        return "spader"
    if "return_scores" in payload:
        return "search_r1"
    return default


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_request(raw: bytes, settings: ServiceSettings) -> RetrieveRequest:
    """Decode and validate a request body; raises :class:`RequestError` (400/413/422)."""
    if len(raw) > settings.max_body_bytes:
        raise RequestError(413, f"request body exceeds {settings.max_body_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {err.start})") from None
    try:
        payload = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise RequestError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(payload, dict):
        raise RequestError(422, f"request body must be a JSON object, got {type(payload).__name__}")
    if "queries" not in payload:
        raise RequestError(422, "missing required field 'queries' (a non-empty list of strings)")
    queries = payload["queries"]
    if isinstance(queries, list) and len(queries) > settings.max_queries:  # before validating each one
        raise RequestError(422, f"too many queries: {len(queries)} > {settings.max_queries}")
    try:
        body = _Body.model_validate(payload)
    except ValidationError as err:
        raise RequestError(422, f"invalid request: {_describe(err)}") from None
    queries = body.queries
    if not queries:
        raise RequestError(422, "'queries' must not be empty")
    if len(queries) > settings.max_queries:
        raise RequestError(422, f"too many queries: {len(queries)} > {settings.max_queries}")
    for i, q in enumerate(queries):
        if not q.strip():
            raise RequestError(422, f"queries[{i}] is empty")
        if len(q) > settings.max_query_chars:
            raise RequestError(422, f"queries[{i}] is longer than {settings.max_query_chars} characters")
    topk = body.topk or settings.default_topk  # reference: 0/null mean the default
    if topk < 0 or topk > settings.max_topk:
        raise RequestError(422, f"topk must be between 1 and {settings.max_topk}, got {body.topk}")
    initial_k = body.initial_k or settings.default_initial_k
    if initial_k < 0 or initial_k > settings.max_initial_k:
        raise RequestError(422, f"initial_k must be between 1 and {settings.max_initial_k}, got {body.initial_k}")
    style = detect_style(payload, settings.default_style)
    max_chars = body.max_chars if "max_chars" in payload and body.max_chars is not None else (
        settings.default_max_chars if style == "spader" else None
    )
    return RetrieveRequest(
        queries=tuple(queries), topk=topk, initial_k=initial_k, style=style,
        return_scores=bool(body.return_scores), max_chars=max_chars, use_reranker=body.use_reranker,
    )


def _search_r1_document(hit: dict[str, Any]) -> dict[str, Any]:
    # wiki-18 convention: the first line of ``contents`` is the quoted title (VERL's formatter
    # shows that line as "Title:"); the bare title is kept as an extra key.
    title = hit.get("title") or ""
    contents = f'"{title}"\n{hit["contents"]}' if title else hit["contents"]
    return {"id": hit["id"], "title": title, "contents": contents}


def render_response(request: RetrieveRequest, hits: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """The response body for ``request`` given per-query ``hits`` (``{"id","title","contents","score"}``)."""
    if request.style == "search_r1":
        if request.return_scores:
            return {"result": [[{"document": _search_r1_document(h), "score": h["score"]} for h in hs] for hs in hits]}
        return {"result": [[_search_r1_document(h) for h in hs] for hs in hits]}
    if request.return_scores:
        docs = [[{"document": {"id": h["id"], "title": h["title"], "contents": h["contents"]}, "score": h["score"]}
                 for h in hs] for hs in hits]
    else:
        docs = [[{"id": h["id"], "title": h["title"], "contents": h["contents"]} for h in hs] for hs in hits]
    try:
        return apply_budget(request.queries, docs, request.max_chars)
    except BudgetTooSmall as err:
        raise RequestError(422, str(err)) from None
