"""Client side of the search service (docs/retrieval.md): an async client with pooling, timeouts and
bounded retries, a sync convenience, and :func:`running_service`, which runs a server subprocess.

Retries follow the published clients: HTTP 500/502/503/504, connection errors and timeouts are
retried (here with exponential backoff ``backoff * 2**attempt``, capped); any other 4xx fails at
once with the server's message. After the last attempt :class:`RetrievalError` says what failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from spader_pipeline.local_servers import free_port, stop_process_group, wait_healthy
from spader_pipeline.retrieval.schemas import Document, QueryResult, SearchResponse

RETRY_STATUSES = frozenset({500, 502, 503, 504})
MAX_BACKOFF_S = 10.0


class RetrievalError(RuntimeError):
    """The service could not answer (after all retries, or because it refused the request)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _endpoint(base_url: str) -> tuple[str, str]:
    base = base_url.rstrip("/").removesuffix("/retrieve")
    return base, base + "/retrieve"


def _payload(queries: Sequence[str], topk: int, max_chars: int | None, initial_k: int | None,
             use_reranker: bool | None) -> dict[str, Any]:
    if isinstance(queries, str):
        raise TypeError("queries must be a sequence of strings, not a single string")
    # SPADER-style request (initial_k/max_chars keys present) with scores; max_chars None → 0 = no budget.
    return {"queries": list(queries), "topk": topk, "initial_k": initial_k,
            "max_chars": 0 if max_chars is None else max_chars, "use_reranker": use_reranker,
            "return_scores": True}


def _parse(body: dict[str, Any]) -> SearchResponse:
    results = []
    for item in body["result"]:
        docs = []
        for entry in item["documents"]:
            doc = entry["document"] if "document" in entry else entry
            docs.append(Document(id=str(doc.get("id", "")), title=doc.get("title") or "",
                                 contents=doc["contents"], score=entry.get("score")))
        results.append(QueryResult(query=item["query"], documents=docs))
    return SearchResponse(results=results, truncation_warning=body.get("truncation_warning"))


def _refusal(response: httpx.Response) -> RetrievalError:
    try:
        message = response.json().get("error", response.text)
    except ValueError:
        message = response.text
    return RetrievalError(f"retrieval service refused the request ({response.status_code}): {message}",
                          response.status_code)


def _accept(response: httpx.Response) -> SearchResponse | str:
    """The parsed answer of a 200, the reason to retry for a retryable status (5xx), or raise the
    service's refusal (4xx) — shared by the async and blocking request loops."""
    if response.status_code == 200:
        return _parse(response.json())
    if response.status_code not in RETRY_STATUSES:
        raise _refusal(response)
    return f"HTTP {response.status_code}: {response.text[:200]}"


def _blocking(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """``fn`` as a coroutine function that runs it in place (no event loop involved)."""

    async def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


def _run_blocking(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that awaits only :func:`_blocking` calls, which never suspend, to its end."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a blocking request suspended: only _blocking() awaitables may be used")


class RetrievalClient:
    """Talks to ``POST {base_url}/retrieve``. Use as ``async with RetrievalClient(url) as c: ...``.

    ``timeout`` is per attempt (seconds); ``max_retries`` extra attempts follow the first one.
    """

    def __init__(self, base_url: str, *, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                 max_connections: int = 64, trust_env: bool = False) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.base_url, self.url = _endpoint(base_url)
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._trust_env = trust_env  # False: HTTP(S)_PROXY variables never reroute the (local) service
        self._async: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None  # the loop ``_async``'s connections live in
        self._sync: httpx.Client | None = None

    def _delay(self, attempt: int) -> float:
        return min(self.backoff * (2**attempt), MAX_BACKOFF_S)

    def _give_up(self, attempts: int, last: str) -> RetrievalError:
        return RetrievalError(f"POST {self.url} failed after {attempts} attempt(s); last error: {last}")

    async def _request(self, payload: dict[str, Any], post: Callable[..., Awaitable[httpx.Response]],
                       sleep: Callable[[float], Awaitable[None]]) -> SearchResponse:
        """The one retry loop, for both transports: ``post``/``sleep`` are the async client's, or
        the blocking client's wrapped by :func:`_blocking` (then this coroutine never suspends)."""
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                outcome = _accept(await post(self.url, json=payload))
            except httpx.TransportError as err:  # connection refused/reset, timeouts
                outcome = f"{type(err).__name__}: {err}"
            if isinstance(outcome, SearchResponse):
                return outcome
            last = outcome
            if attempt < self.max_retries:
                await sleep(self._delay(attempt))
        raise self._give_up(self.max_retries + 1, last)

    async def search(self, queries: Sequence[str], topk: int = 5, max_chars: int | None = None,
                     initial_k: int | None = None, use_reranker: bool | None = None) -> SearchResponse:
        payload = _payload(queries, topk, max_chars, initial_k, use_reranker)
        return await self._request(payload, self._client_of_this_loop().post, asyncio.sleep)

    def search_sync(self, queries: Sequence[str], topk: int = 5, max_chars: int | None = None,
                    initial_k: int | None = None, use_reranker: bool | None = None) -> SearchResponse:
        """Blocking twin of :meth:`search` (own pooled ``httpx.Client``, same retry loop)."""
        payload = _payload(queries, topk, max_chars, initial_k, use_reranker)
        if self._sync is None:
            self._sync = httpx.Client(timeout=self.timeout, limits=self._limits, trust_env=self._trust_env)
        return _run_blocking(self._request(payload, _blocking(self._sync.post), _blocking(time.sleep)))

    async def health(self) -> dict[str, Any]:
        response = await self._client_of_this_loop().get(self.base_url + "/health")
        response.raise_for_status()
        return response.json()

    def _client_of_this_loop(self) -> httpx.AsyncClient:
        """The pooled async client of the running event loop. A pooled connection belongs to the loop
        that opened it: a rollout runs each batch under its own ``asyncio.run``, and a connection kept
        from a closed loop fails the next loop's request with ``Event loop is closed``. So each loop
        gets its own client; a closed loop's client is dropped (its sockets close with the loop's
        transports, and awaiting its ``aclose`` in another loop would fail the same way)."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            self._async = httpx.AsyncClient(timeout=self.timeout, limits=self._limits, trust_env=self._trust_env)
            self._async_loop = loop
        return self._async

    async def aclose(self) -> None:
        if self._async is not None and self._async_loop is asyncio.get_running_loop():
            await self._async.aclose()
        self._async = self._async_loop = None
        self.close()

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    async def __aenter__(self) -> RetrievalClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __enter__(self) -> RetrievalClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def running_service(index_dir: str | os.PathLike, host: str = "127.0.0.1", port: int | None = None, *,
                    startup_timeout: float = 180.0, extra_args: Sequence[str] = (),
                    log_path: str | os.PathLike | None = None,
                    env: Mapping[str, str] | None = None) -> Iterator[str]:
    """Run ``spader-retrieval serve --index index_dir`` on a free port; yield its base URL.

    Waits for ``/health`` and always stops the server (SIGTERM to its process group, then SIGKILL),
    also when the body raises. The server's output goes to ``log_path`` (a temp file by default);
    its tail is included in the error if the server fails to start. ``env`` adds environment
    variables for the server process.
    """
    port = port or free_port(host)
    base_url = f"http://{host}:{port}"
    log_file = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="spader-retrieval-", suffix=".log")[1])
    command = [sys.executable, "-m", "spader_pipeline.retrieval.cli", "serve", "--index", str(index_dir),
               "--host", host, "--port", str(port), *extra_args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log_file, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        try:
            wait_healthy(base_url, startup_timeout, process, name="retrieval server")
        except (RuntimeError, TimeoutError) as err:
            tail = log_file.read_text(encoding="utf-8", errors="replace")[-3000:]
            raise RuntimeError(f"{err}\n--- server log ({log_file}) ---\n{tail}") from None
        yield base_url
    finally:
        stop_process_group(process)
