"""The in-process searcher: first-stage retriever + document store + optional reranker,
:class:`SearchBatcher`, which answers concurrent searches of an event loop in batches (the HTTP
service's and :class:`LocalSearch`'s), and :class:`LocalSearch`, the same searcher behind the async
interface of the HTTP client."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np

from spader_pipeline.retrieval.bm25 import passage_text
from spader_pipeline.retrieval.client import _parse
from spader_pipeline.retrieval.corpus import DocStore, Passage
from spader_pipeline.retrieval.schemas import Document, QueryResult, SearchResponse
from spader_pipeline.retrieval.wire import RequestError, RetrieveRequest, render_response

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
        answer = self.answer_batch([local_request(queries, topk, max_chars, initial_k, use_reranker)])[0]
        if isinstance(answer, RequestError):
            raise answer
        return _parse(answer)

    def answer_batch(self, requests: Sequence[RetrieveRequest]) -> list[dict[str, Any] | RequestError]:
        """Each request's response body (:func:`~spader_pipeline.retrieval.wire.render_response`), or the
        :class:`RequestError` that refuses it (a budget too small for its echoed queries).

        The requests without a cross-encoder pass share one first-stage call over their distinct queries at
        the largest ``topk`` (one sparse product for BM25; a rollout group's trajectories often search alike),
        each truncated to its own ``topk`` (a top-k' of the same ranking); a reranked request runs on its
        own, as :meth:`search_hits` runs it.
        """
        out: list[dict[str, Any] | RequestError] = [{} for _ in requests]
        reranked = [self.wants_rerank(r.use_reranker) for r in requests]
        plain = [i for i, rerank in enumerate(reranked) if not rerank]
        if plain:
            queries = [q for i in plain for q in requests[i].queries]
            distinct = list(dict.fromkeys(queries))
            ranking = dict(zip(distinct, self.retriever.search(distinct, max(requests[i].topk for i in plain)),
                               strict=True))
            ranked = iter(ranking[q] for q in queries)
            for i in plain:
                topk = requests[i].topk
                hits = [self.hits(rows[:topk], scores[:topk]) for rows, scores in (next(ranked) for _ in requests[i].queries)]
                out[i] = _rendered(requests[i], hits)
        for i, (request, rerank) in enumerate(zip(requests, reranked, strict=True)):
            if rerank:
                hits = self.search_hits(request.queries, request.topk, initial_k=request.initial_k,
                                        use_reranker=request.use_reranker)
                out[i] = _rendered(request, hits)
        return out

    def close(self) -> None:
        self.docs.close()


def local_request(queries: Sequence[str], topk: int = 5, max_chars: int | None = None, initial_k: int | None = None,
                  use_reranker: bool | None = None) -> RetrieveRequest:
    """The request an in-process search answers: the SPADER response style with scores, as the HTTP
    client asks for (:meth:`Searcher.respond`, :class:`LocalSearch`)."""
    return RetrieveRequest(queries=tuple(queries), topk=topk, initial_k=initial_k or 50, style="spader",
                           return_scores=True, max_chars=max_chars, use_reranker=use_reranker)


def _rendered(request: RetrieveRequest, hits: Sequence[Sequence[Hit]]) -> dict[str, Any] | RequestError:
    try:
        return render_response(request, hits)
    except RequestError as err:  # e.g. a budget too small for the echoed queries
        return err


class SearchBatcher:
    """Answers the concurrent searches of one event loop in batches, each one :meth:`Searcher.answer_batch`
    in a worker thread.

    A submitted request joins the pending batch; the batch starts once the loop has run everything that
    was ready with the first request (all the searches one rollout round, or one burst of HTTP requests,
    issues together), or ``window_s`` later, and requests that arrive while ``slots`` batches run form
    the next. ``render`` turns a response body into what the caller gets (in the worker thread: the
    HTTP service's JSON bytes, :class:`LocalSearch`'s :class:`SearchResponse`); a refused request gets its
    :class:`RequestError`, and a failed batch's exception reaches every request of it. ``executor``:
    the worker threads (``None``: the loop's default executor); ``max_queries`` bounds a batch's
    queries (``None``: no bound).
    """

    def __init__(self, searcher: Searcher, *, render: Callable[[dict[str, Any]], Any], slots: int = 1,
                 max_queries: int | None = None, window_s: float = 0.0, executor: Executor | None = None) -> None:
        self.searcher = searcher
        self.render = render
        self.slots = slots
        self.max_queries = max_queries
        self.window_s = window_s
        self.executor = executor
        self.pending: list[tuple[RetrieveRequest, asyncio.Future]] = []
        self.running = 0
        self.scheduled = False

    def submit(self, request: RetrieveRequest) -> asyncio.Future:
        """A future of ``request``'s rendered answer or its :class:`RequestError`."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((request, future))
        if not self.scheduled and self.running < self.slots:
            self.scheduled = True  # start after the requests issued in this loop iteration joined
            if self.window_s > 0:
                loop.call_later(self.window_s, self._start, loop)
            else:
                loop.call_soon(self._start, loop)
        return future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.scheduled = False
        while self.pending and self.running < self.slots:
            size, cut = 0, 0
            while cut < len(self.pending) and (cut == 0 or self.max_queries is None
                                               or size + len(self.pending[cut][0].queries) <= self.max_queries):
                size += len(self.pending[cut][0].queries)
                cut += 1
            batch, self.pending = self.pending[:cut], self.pending[cut:]
            self.running += 1
            work = loop.run_in_executor(self.executor, self.run_batch, [request for request, _ in batch])
            work.add_done_callback(lambda done, batch=batch: self._finish(loop, batch, done))

    def _finish(self, loop: asyncio.AbstractEventLoop, batch, done: asyncio.Future) -> None:
        self.running -= 1
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is not None:
            logger.error("search failed: %s: %s", type(error).__name__, error)
        for index, (_, future) in enumerate(batch):
            if future.done():  # its caller was cancelled
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result()[index])
        if self.pending:
            self._start(loop)

    def run_batch(self, requests: list[RetrieveRequest]) -> list[Any]:
        """Worker thread: the batch's answers (:meth:`Searcher.answer_batch`), rendered."""
        return [a if isinstance(a, RequestError) else self.render(a) for a in self.searcher.answer_batch(requests)]


class LocalSearch:
    """An in-process searcher (``load_retriever(index_dir)``) with the async ``search`` of
    :class:`~spader_pipeline.retrieval.client.RetrievalClient`.

    :meth:`Searcher.respond` applies the same ranking *and* character budget (``max_chars``) as the
    HTTP service, so in-process training sees exactly the observations an evaluation against the
    service sees. Concurrent searches (a rollout round's trajectories each search at once) are answered
    as the service answers concurrent requests: in batches, one first-stage call each
    (:class:`SearchBatcher`, one per event loop), where one worker thread per search would cost more in
    hand-offs than the searches take.
    """

    def __init__(self, retriever: Any) -> None:
        self.retriever = retriever
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SearchBatcher] = weakref.WeakKeyDictionary()

    async def search(self, queries: Sequence[str], topk: int = 5, max_chars: int | None = None) -> SearchResponse:
        request = local_request(queries, topk, max_chars)
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None:
            batcher = self._batchers[loop] = SearchBatcher(self.retriever, render=_parse)
        answer = await batcher.submit(request)
        if isinstance(answer, RequestError):
            raise answer
        return answer
