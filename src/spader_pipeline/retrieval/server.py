"""The HTTP search service: ``create_app(searcher, settings)`` builds a FastAPI app (no globals).

``GET /health`` → ``{"status": "ok", "method", "num_docs", "reranker"}``.
``POST /retrieve`` → both published response styles (:mod:`.wire`). The body is read with a byte
cap before parsing, validated, and the search + rendering run on a bounded worker-thread pool, so
a slow search never blocks the event loop. Refused input gets a 4xx JSON ``{"error": message}``;
the server keeps serving.
"""

from __future__ import annotations

import logging

import anyio
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from spader_pipeline.retrieval.schemas import ServiceSettings
from spader_pipeline.retrieval.service import Searcher
from spader_pipeline.retrieval.wire import RequestError, parse_request, render_response

logger = logging.getLogger(__name__)


def _json(body, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, "invalid Content-Length header")
        if int(declared) > limit:
            raise RequestError(413, f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # chunked uploads are capped while they arrive
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(searcher: Searcher, settings: ServiceSettings | None = None) -> FastAPI:
    """A FastAPI app serving ``searcher`` under ``settings`` (defaults: :class:`ServiceSettings`)."""
    settings = settings or ServiceSettings()
    app = FastAPI(title="spader-pipeline retrieval", docs_url=None, redoc_url=None, openapi_url=None)
    limiter = anyio.CapacityLimiter(settings.search_threads)
    app.state.searcher = searcher
    app.state.settings = settings

    def run(request) -> bytes:
        hits = searcher.search_hits(request.queries, request.topk, initial_k=request.initial_k,
                                    use_reranker=request.use_reranker)
        return orjson.dumps(render_response(request, hits))

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok", "method": searcher.method, "num_docs": searcher.retriever.num_docs,
                      "reranker": searcher.reranker is not None})

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        try:
            parsed = parse_request(await _read_body(request, settings.max_body_bytes), settings)
            payload = await anyio.to_thread.run_sync(run, parsed, limiter=limiter)
        except RequestError as err:
            return _json({"error": err.message}, err.status)
        except Exception as err:  # a search failure: 500, which clients retry
            logger.exception("search failed")
            return _json({"error": f"search failed: {type(err).__name__}: {err}"}, 500)
        return Response(payload, media_type="application/json")

    return app


def serve(searcher: Searcher, settings: ServiceSettings) -> None:
    """Run the app under uvicorn until interrupted (binds ``settings.host``, 127.0.0.1 by default)."""
    import gc

    import uvicorn

    gc.freeze()  # the loaded index is long-lived: keep it out of the collector's scans (fewer pauses)
    uvicorn.run(
        create_app(searcher, settings), host=settings.host, port=settings.port, log_level=settings.log_level,
        limit_concurrency=settings.limit_concurrency, access_log=False, timeout_keep_alive=30,
    )
