"""The HTTP search service: ``create_app(searcher, settings)`` builds a lean ASGI app (no globals).

``GET /health`` → ``{"status": "ok", "method", "num_docs", "reranker"}``.
``POST /retrieve`` → both published response styles (:mod:`.wire`). The body is read with a byte
cap before parsing and validated; refused input gets a 4xx JSON ``{"error": message}`` and the
server keeps serving.

Concurrent requests are **coalesced** (:class:`~spader_pipeline.retrieval.service.SearchBatcher`, as
in-process searches are): each parsed request joins a pending batch, and one worker thread runs the
whole batch as a single first-stage call (``retriever.search`` over every query of every request, one
sparse product for BM25), then renders each request's answer with orjson. A batch starts as soon as
the event loop has parsed everything that arrived with the first request (optionally after
``batch_window_ms``), and requests that arrive while it runs form the next one, so batches grow with
the load and a lone request waits for nobody. The event loop itself only
parses, hands over and writes, so health checks are answered while searches run.

The app is a plain ASGI callable rather than a web framework's router: per request it does the
HTTP bookkeeping of two routes and nothing else (measured in ``bench_retrieval_server.py``).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from spader_pipeline.retrieval.schemas import ServiceSettings
from spader_pipeline.retrieval.service import SearchBatcher, Searcher
from spader_pipeline.retrieval.wire import RequestError, parse_request

logger = logging.getLogger(__name__)

_JSON_HEADERS = [(b"content-type", b"application/json")]


def _error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


class RetrievalApp:
    """ASGI app serving ``searcher`` under ``settings`` (see the module docstring)."""

    def __init__(self, searcher: Searcher, settings: ServiceSettings) -> None:
        self.searcher = searcher
        self.settings = settings
        self.batcher = SearchBatcher(
            searcher, render=orjson.dumps, slots=settings.search_threads, max_queries=settings.batch_max_queries,
            window_s=settings.batch_window_ms / 1000.0,
            executor=ThreadPoolExecutor(max_workers=settings.search_threads, thread_name_prefix="search"))

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.batcher.executor.shutdown(wait=False, cancel_futures=True)
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _http(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/retrieve":
            if method != "POST":
                return await _reply(send, 405, _error_body("method not allowed: use POST"))
            try:
                raw = await _read_body(scope, receive, self.settings.max_body_bytes)
                result = await self.batcher.submit(parse_request(raw, self.settings))
            except RequestError as err:
                result = err
            except Exception as err:  # never leave a client without an answer
                logger.exception("request failed")
                result = RequestError(500, f"search failed: {type(err).__name__}: {err}")
            if isinstance(result, RequestError):
                return await _reply(send, result.status, _error_body(result.message))
            return await _reply(send, 200, result)
        if path == "/health":
            if method not in ("GET", "HEAD"):
                return await _reply(send, 405, _error_body("method not allowed: use GET"))
            return await _reply(send, 200, orjson.dumps({
                "status": "ok", "method": self.searcher.method, "num_docs": self.searcher.retriever.num_docs,
                "reranker": self.searcher.reranker is not None,
            }))
        return await _reply(send, 404, _error_body(f"not found: {path}"))


async def _reply(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(scope, receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise RequestError(400, "invalid Content-Length header")
            if int(value) > limit:
                raise RequestError(413, f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:  # chunked uploads are capped while they arrive
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError(400, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def create_app(searcher: Searcher, settings: ServiceSettings | None = None) -> RetrievalApp:
    """An ASGI app serving ``searcher`` under ``settings`` (defaults: :class:`ServiceSettings`)."""
    return RetrievalApp(searcher, settings or ServiceSettings())


def serve(searcher: Searcher, settings: ServiceSettings) -> None:
    """Run the app under uvicorn until interrupted (binds ``settings.host``, 127.0.0.1 by default)."""
    import gc

    import uvicorn

    gc.freeze()  # the loaded index is long-lived: keep it out of the collector's scans (fewer pauses)
    config = uvicorn.Config(
        create_app(searcher, settings), host=settings.host, port=settings.port, log_level=settings.log_level,
        limit_concurrency=settings.limit_concurrency, access_log=False, timeout_keep_alive=30,
        loop="auto", http="auto", lifespan="on", proxy_headers=False, server_header=False, date_header=False,
    )
    quiet_server(config).run()


def quiet_server(config: Any) -> Any:
    """A ``uvicorn.Server`` for ``config`` whose event loop sleeps while nothing arrives.

    uvicorn's main loop wakes ten times a second to look for a shutdown request. On a virtual machine
    where waking a sleeping process costs milliseconds of CPU (nested virtualisation), that tick alone
    kept an idle server at ~20% of a core (docs/retrieval.md, "An idle server"). This one waits until
    a signal (SIGINT, SIGTERM: uvicorn's handler) asks it to stop, then shuts down as uvicorn does. It
    serves only in a process's main thread, where uvicorn installs its signal handlers.
    """
    import asyncio

    import uvicorn

    class QuietServer(uvicorn.Server):
        _stop_requested: asyncio.Event
        _loop: asyncio.AbstractEventLoop | None = None

        async def main_loop(self) -> None:
            self._stop_requested = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            while not await self.on_tick(0):  # uvicorn's own exit checks, at each wakeup
                await self._stop_requested.wait()
                self._stop_requested.clear()

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if self._loop is not None:  # before the main loop runs, its first check sees should_exit
                self._loop.call_soon_threadsafe(self._stop_requested.set)

    return QuietServer(config)
