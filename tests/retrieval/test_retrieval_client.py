"""Client retries against a real flaky HTTP server on 127.0.0.1, and request-style detection."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from spader_pipeline.local_servers import free_port
from spader_pipeline.retrieval import RetrievalClient, RetrievalError
from spader_pipeline.retrieval.schemas import ServiceSettings
from spader_pipeline.retrieval.wire import RequestError, detect_style, parse_request

OK = {"result": [{"query": "q", "documents": [{"document": {"id": "1", "title": "T", "contents": "c"}, "score": 1.5}]}]}


class FlakyServer:
    """Answers ``plan`` status codes in turn (then 200), recording each request body."""

    def __init__(self, plan):
        self.plan = list(plan)
        self.bodies = []
        app = FastAPI()

        @app.post("/retrieve")
        async def retrieve(body: dict):
            self.bodies.append(body)
            if self.plan:
                status = self.plan.pop(0)
                return JSONResponse({"error": f"planned {status}"}, status_code=status)
            return OK

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_retries_5xx_with_backoff_then_succeeds():
    with FlakyServer([503, 500, 502]) as url:
        client = RetrievalClient(url, max_retries=3, backoff=0.05)
        started = time.perf_counter()
        response = asyncio.run(client.search(["q"], topk=1))
        elapsed = time.perf_counter() - started
    assert response.results[0].documents[0].score == 1.5
    assert elapsed >= 0.05 + 0.1 + 0.2 - 0.01  # exponential backoff between the 4 attempts


def test_gives_up_after_the_last_attempt_with_a_clear_error():
    server = FlakyServer([503] * 10)
    with server as url:
        client = RetrievalClient(url, max_retries=2, backoff=0.01)
        with pytest.raises(RetrievalError, match=r"failed after 3 attempt\(s\); last error: HTTP 503"):
            client.search_sync(["q"])
    assert len(server.bodies) == 3


def test_4xx_is_not_retried():
    server = FlakyServer([422, 422])
    with server as url, pytest.raises(RetrievalError, match="422"):
        asyncio.run(RetrievalClient(url, max_retries=5, backoff=0.01).search(["q"]))
    assert len(server.bodies) == 1


def test_client_sends_a_spader_style_body():
    server = FlakyServer([])
    with server as url:
        RetrievalClient(url).search_sync(["a", "b"], topk=4, max_chars=900, initial_k=20)
    assert server.bodies == [{"queries": ["a", "b"], "topk": 4, "initial_k": 20, "max_chars": 900,
                              "use_reranker": None, "return_scores": True}]
    with pytest.raises(TypeError):
        RetrievalClient(url).search_sync("not a list")


@pytest.mark.parametrize(
    ("payload", "style"),
    [
        ({"queries": ["q"], "topk": 3, "return_scores": True}, "search_r1"),  # VERL search_r1_like, Search-R1
        ({"queries": ["q"], "topk": 5, "initial_k": 50, "max_chars": 10000, "use_reranker": None}, "spader"),
        ({"queries": ["q"], "topk": 5, "max_chars": 10000, "initial_k": 50}, "spader"),  # SPADER eval
        ({"queries": ["q"], "max_chars": None}, "spader"),
        ({"queries": ["q"]}, "search_r1"),  # no style key: the configured default
        ({"queries": ["q"], "return_scores": True, "response_format": "spader"}, "spader"),
    ],
)
def test_detect_style(payload, style):
    assert detect_style(payload, "search_r1") == style


def test_parse_request_defaults_follow_the_reference():
    settings = ServiceSettings()
    spader = parse_request(b'{"queries": ["q"], "topk": null, "initial_k": null, "max_chars": null}', settings)
    assert (spader.topk, spader.initial_k, spader.max_chars, spader.style) == (5, 50, 10000, "spader")
    search_r1 = parse_request(b'{"queries": ["q"], "return_scores": true}', settings)
    assert (search_r1.max_chars, search_r1.return_scores, search_r1.style) == (None, True, "search_r1")
    assert parse_request(b'{"queries": ["q"], "max_chars": -1}', settings).max_chars == -1
    with pytest.raises(RequestError) as info:
        parse_request(b"x" * (settings.max_body_bytes + 1), settings)
    assert info.value.status == 413


def test_a_slow_search_does_not_block_the_event_loop(bm25_index):
    """While one search is stuck in the worker thread, /health (and the event loop) still answer."""
    import httpx

    from spader_pipeline.retrieval import create_app, load_retriever

    started, release = threading.Event(), threading.Event()
    searcher = load_retriever(bm25_index)
    fast_search = searcher.retriever.search

    def held_search(queries, k):
        started.set()
        release.wait(timeout=30)
        return fast_search(queries, k)

    searcher.retriever.search = held_search
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(searcher), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    async def scenario():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            pending = asyncio.create_task(client.post("/retrieve", json={"queries": ["Accra"], "return_scores": True}))
            await asyncio.to_thread(started.wait, 10)
            health = await client.get("/health")
            assert health.status_code == 200 and not pending.done()
            release.set()
            return await pending

    try:
        response = asyncio.run(scenario())
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=10)
    assert response.json()["result"][0][0]["document"]["title"] == "Ghana"


def test_one_client_serves_one_event_loop_after_another():
    """A rollout runs each batch under its own ``asyncio.run``; the pooled connections of a closed loop
    must not serve the next one (they failed as ``Event loop is closed``, one search per batch)."""
    with FlakyServer([]) as url:
        client = RetrievalClient(url, max_retries=0)

        async def batch():
            return await asyncio.gather(*(client.search([f"q{k}"], topk=1) for k in range(8)),
                                        return_exceptions=True)

        outcomes = [asyncio.run(batch()) for _ in range(3)]
        asyncio.run(client.aclose())
    failures = [repr(o) for batch_outcomes in outcomes for o in batch_outcomes if isinstance(o, BaseException)]
    assert failures == []
