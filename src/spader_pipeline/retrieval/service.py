"""The in-process searcher: first-stage retriever + document store + optional reranker, and
:class:`LocalSearch`, the same searcher behind the async interface of the HTTP client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from spader_pipeline.retrieval.bm25 import passage_text
from spader_pipeline.retrieval.corpus import DocStore, Passage
from spader_pipeline.retrieval.schemas import Document, QueryResult, SearchResponse

logger = logging.getLogger(__name__)

Hit = dict[str, Any]  # {"id", "title", "contents", "score"}


class FirstStage(Protocol):
    name: str
    num_docs: int

    def search(self, queries: Sequence[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query: ``(rows [<=k] int64, scores [<=k] float32)``, best first."""
        ...


class Searcher:
    """Answers ``search(queries, topk)`` from an index folder (see :func:`~.index.load_retriever`)."""

    def __init__(self, retriever: FirstStage, docs: DocStore, *, reranker=None,
                 manifest: dict[str, Any] | None = None, rerank_by_default: bool = True) -> None:
        self.retriever = retriever
        self.docs = docs
        self.reranker = reranker
        self.manifest = manifest or {}
        self.rerank_by_default = rerank_by_default
        self._warned_no_reranker = False

    @property
    def method(self) -> str:
        return self.retriever.name

    def wants_rerank(self, use_reranker: bool | None) -> bool:
        if use_reranker is None:
            return self.reranker is not None and self.rerank_by_default
        if use_reranker and self.reranker is None and not self._warned_no_reranker:
            logger.warning("use_reranker=true but no reranker is configured; serving first-stage results")
            self._warned_no_reranker = True
        return bool(use_reranker) and self.reranker is not None

    def hits(self, rows: np.ndarray, scores: np.ndarray) -> list[Hit]:
        """The passages at ``rows`` (best first) as plain dicts with their ``score``."""
        out = self.docs.get_many(rows)
        for hit, score in zip(out, scores.tolist(), strict=True):
            hit["score"] = score
        return out

    def search_hits(self, queries: Sequence[str], topk: int, *, initial_k: int = 50,
                    use_reranker: bool | None = None) -> list[list[Hit]]:
        """Per query, up to ``topk`` passages as plain dicts, best first."""
        rerank = self.wants_rerank(use_reranker)
        depth = max(topk, initial_k) if rerank else topk
        out: list[list[Hit]] = []
        for query, (rows, scores) in zip(queries, self.retriever.search(queries, depth), strict=True):
            hits = self.hits(np.asarray(rows), np.asarray(scores, dtype=np.float64))
            if rerank and hits:
                texts = [passage_text(Passage(h["id"], h["title"], h["contents"]), True) for h in hits]
                scores = self.reranker.scores(query, texts)
                order = np.argsort(-scores, kind="stable")[:topk]
                hits = [hits[i] for i in order]
                for hit, score in zip(hits, scores[order].tolist(), strict=True):
                    hit["score"] = score
            out.append(hits[:topk])
        return out

    def search(self, queries: Sequence[str], topk: int = 5, *, initial_k: int = 50,
               use_reranker: bool | None = None) -> list[QueryResult]:
        """In-process search: one :class:`QueryResult` per query, in order, as the client returns them."""
        hits = self.search_hits(queries, topk, initial_k=initial_k, use_reranker=use_reranker)
        return [QueryResult(query=q, documents=[Document(**h) for h in hs]) for q, hs in zip(queries, hits, strict=True)]

    def respond(self, queries: Sequence[str], topk: int = 5, max_chars: int | None = None,
                initial_k: int | None = None, use_reranker: bool | None = None) -> SearchResponse:
        """Exactly what :meth:`RetrievalClient.search` returns for the same arguments, computed in
        process: same ranking, same character budget (``max_chars`` None or <= 0: none), same warning."""
        from spader_pipeline.retrieval.client import _parse
        from spader_pipeline.retrieval.wire import RetrieveRequest, render_response

        request = RetrieveRequest(queries=tuple(queries), topk=topk, initial_k=initial_k or 50, style="spader",
                                  return_scores=True, max_chars=max_chars, use_reranker=use_reranker)
        hits = self.search_hits(request.queries, topk, initial_k=request.initial_k, use_reranker=use_reranker)
        return _parse(render_response(request, hits))

    def close(self) -> None:
        self.docs.close()


class LocalSearch:
    """An in-process searcher (``load_retriever(index_dir)``) with the async ``search`` of
    :class:`~spader_pipeline.retrieval.client.RetrievalClient`.

    :meth:`Searcher.respond` applies the same ranking *and* character budget (``max_chars``) as the
    HTTP service, so in-process training sees exactly the observations an evaluation against the
    service sees.
    """

    def __init__(self, retriever: Any) -> None:
        self.retriever = retriever

    async def search(self, queries: Sequence[str], topk: int = 5, max_chars: int | None = None) -> SearchResponse:
        return await asyncio.to_thread(self.retriever.respond, list(queries), topk, max_chars)
