"""A real uvicorn server on 127.0.0.1 (started by the test) serving both published clients,
refusing every kind of bad input with a 4xx while it keeps serving, and holding the budget."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from retrieval_cases import EXPECTED

from spader_pipeline.local_servers import free_port
from spader_pipeline.retrieval import RetrievalClient, RetrievalError, running_service

LIMITS = ["--set", "max_queries=8", "--set", "max_topk=20", "--set", "max_body_bytes=65536",
          "--set", "max_query_chars=500"]


@pytest.fixture(scope="module")
def server(bm25_index):
    with running_service(bm25_index, extra_args=LIMITS) as base_url:
        yield base_url


def post(server, body, **kwargs):
    return httpx.post(server + "/retrieve", json=body, timeout=30, **kwargs)


def assert_alive(server):
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"


def verl_passages_text(result):
    """How VERL's search_r1_like tool turns one query's hits into text: the first line of
    ``contents`` is shown as the title, the rest as the text."""
    parts = []
    for i, item in enumerate(result, start=1):
        lines = item["document"]["contents"].split("\n")
        parts.append(f"Doc {i}(Title: {lines[0]}) {' '.join(lines[1:])}")
    return "\n".join(parts)


def test_health(server):
    body = httpx.get(server + "/health").json()
    assert body == {"status": "ok", "method": "bm25", "num_docs": 28, "reranker": False}


def test_binds_loopback_only(server):
    assert server.startswith("http://127.0.0.1:")


def test_search_r1_verl_client_body(server):
    queries = ["sorcerer Prospero on an island", "largest hot desert in the world"]
    response = post(server, {"queries": queries, "topk": 3, "return_scores": True})
    assert response.status_code == 200
    result = response.json()["result"]
    assert isinstance(result, list) and len(result) == 2 and all(1 <= len(r) <= 3 for r in result)
    for hits in result:
        for hit in hits:
            assert set(hit) == {"document", "score"} and isinstance(hit["score"], float)
            assert {"id", "contents"} <= set(hit["document"])
    assert result[0][0]["document"]["contents"].startswith('"The Tempest"\n')
    assert "Doc 1(Title: \"Sahara\")" in verl_passages_text(result[1])


def test_search_r1_without_scores_gives_bare_documents(server):
    result = post(server, {"queries": ["penguin"], "topk": 2, "return_scores": False}).json()["result"]
    assert set(result[0][0]) == {"id", "title", "contents"}


@pytest.mark.parametrize(
    "body",
    [
        # SPADER training client (verl/tools/utils/search_r1_like_utils.py in the fork)
        {"topk": 5, "initial_k": 50, "max_chars": 10000, "use_reranker": None},
        # SPADER evaluation client (run_test/utils/tools.py): no use_reranker key
        {"topk": 5, "max_chars": 10000, "initial_k": 50},
    ],
    ids=["spader-train", "spader-eval"],
)
def test_spader_client_bodies(server, body):
    queries = list(EXPECTED)[:3]
    response = post(server, {"queries": queries, **body})
    assert response.status_code == 200
    payload = response.json()
    assert [r["query"] for r in payload["result"]] == queries
    for item, query in zip(payload["result"], queries, strict=True):
        assert EXPECTED[query] in [d["title"] for d in item["documents"]]
        assert all(set(d) == {"id", "title", "contents"} for d in item["documents"])
    assert len(json.dumps(payload, indent=2, ensure_ascii=False)) <= 10000


@pytest.mark.parametrize("max_chars", [700, 1500, 3000, 6000])
def test_budget_holds_over_http(server, max_chars):
    queries = ["river", "country in West Africa", "bird", "play by William Shakespeare", "capital"]
    response = post(server, {"queries": queries, "topk": 10, "initial_k": 50, "max_chars": max_chars,
                             "use_reranker": None, "return_scores": True})
    assert response.status_code == 200
    payload = response.json()
    assert len(json.dumps(payload, indent=2, ensure_ascii=False)) <= max_chars
    assert payload["truncation_warning"] == f"System Note: Retrieval results truncated at {max_chars} characters."


def test_explicit_response_format_wins(server):
    result = post(server, {"queries": ["tea"], "response_format": "spader"}).json()["result"]
    assert result[0]["query"] == "tea"


def test_topk_zero_or_null_means_the_default(server):
    for topk in (0, None):
        result = post(server, {"queries": ["the"], "topk": topk, "return_scores": True}).json()["result"]
        assert len(result[0]) <= 5


BAD_JSON_BODIES = {
    "not-json": (b"this is not json", 400, "not valid JSON"),
    "truncated-json": (b'{"queries": ["a"', 400, "not valid JSON"),
    "non-utf8": (b'{"queries": ["caf\xe9"]}', 400, "not valid UTF-8"),
    "json-list": (b'["a", "b"]', 422, "JSON object"),
    "json-string": (b'"queries"', 422, "JSON object"),
    "empty-body": (b"", 400, "not valid JSON"),
    "nested-too-deep": (b'{"queries": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSON_BODIES))
def test_malformed_bodies_get_4xx_and_server_keeps_serving(server, case):
    raw, status, message = BAD_JSON_BODIES[case]
    response = httpx.post(server + "/retrieve", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == status and message in response.json()["error"]
    assert_alive(server)


BAD_FIELDS = {
    "missing-queries": ({"topk": 3}, "missing required field 'queries'"),
    "empty-queries": ({"queries": []}, "must not be empty"),
    "queries-not-list": ({"queries": "capital of Ghana"}, "queries"),
    "query-not-string": ({"queries": ["ok", 7]}, "queries.1"),
    "query-null": ({"queries": [None]}, "queries.0"),
    "empty-string": ({"queries": ["ok", ""]}, "queries[1] is empty"),
    "blank-string": ({"queries": ["   "]}, "queries[0] is empty"),
    "too-many-queries": ({"queries": ["q"] * 9}, "too many queries: 9 > 8"),
    "query-too-long": ({"queries": ["x" * 501]}, "longer than 500"),
    "topk-above-cap": ({"queries": ["q"], "topk": 21}, "topk must be between 1 and 20"),
    "topk-negative": ({"queries": ["q"], "topk": -1}, "topk must be between"),
    "topk-string": ({"queries": ["q"], "topk": "5"}, "topk"),
    "topk-float": ({"queries": ["q"], "topk": 2.5}, "topk"),
    "topk-bool": ({"queries": ["q"], "topk": True}, "topk"),
    "initial-k-above-cap": ({"queries": ["q"], "initial_k": 10**9}, "initial_k must be between"),
    "max-chars-string": ({"queries": ["q"], "max_chars": "10000"}, "max_chars"),
    "return-scores-string": ({"queries": ["q"], "return_scores": "yes"}, "return_scores"),
    "use-reranker-int": ({"queries": ["q"], "use_reranker": 2}, "use_reranker"),
    "unknown-format": ({"queries": ["q"], "response_format": "xml"}, "response_format"),
    "budget-below-skeleton": ({"queries": ["q" * 400], "max_chars": 100}, "smaller than the response skeleton"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_invalid_fields_get_422_with_a_message(server, case):
    body, message = BAD_FIELDS[case]
    response = post(server, body)
    assert response.status_code == 422, response.text
    assert message in response.json()["error"]
    assert_alive(server)


def test_oversized_body_is_refused_before_reading(server):
    response = httpx.post(server + "/retrieve", content=b'{"queries": ["' + b"a" * 70000 + b'"]}')
    assert response.status_code == 413 and "65536 bytes" in response.json()["error"]
    assert_alive(server)


def test_oversized_chunked_body_is_capped_while_streaming(server):
    def chunks():
        yield b'{"queries": ["'
        for _ in range(200):
            yield b"b" * 1024
        yield b'"]}'

    response = httpx.post(server + "/retrieve", content=chunks())
    assert response.status_code == 413
    assert_alive(server)


def test_lying_content_length_is_refused(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{}")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")
    assert_alive(server)


def test_wrong_method_and_path(server):
    assert httpx.get(server + "/retrieve").status_code == 405
    assert httpx.post(server + "/search", json={"queries": ["q"]}).status_code == 404
    assert_alive(server)


def test_concurrent_mixed_requests_all_answered(server):
    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            good = [client.post(server + "/retrieve", json={"queries": [q], "topk": 3, "return_scores": True})
                    for q in EXPECTED]
            bad = [client.post(server + "/retrieve", content=b"\xff" * 10) for _ in range(8)]
            return await asyncio.gather(*good, *bad)

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(EXPECTED) + [400] * 8


def test_async_client_against_server(server):
    async def run():
        async with RetrievalClient(server, timeout=10, max_retries=1) as client:
            return await client.search(list(EXPECTED), topk=3, max_chars=None), await client.health()

    response, health = asyncio.run(run())
    assert health["num_docs"] == 28 and response.truncation_warning is None
    for result in response.results:
        assert EXPECTED[result.query] in [d.title for d in result.documents]
        assert all(d.score is not None and d.id.startswith("doc-") for d in result.documents)


def test_sync_client_budget_and_refusal(server):
    with RetrievalClient(server + "/retrieve", timeout=10, max_retries=2, backoff=0.01) as client:
        response = client.search_sync(["river", "bird", "country"], topk=5, max_chars=2000)
        assert response.truncation_warning is not None
        with pytest.raises(RetrievalError, match=r"refused the request \(422\).*topk") as info:
            client.search_sync(["q"], topk=99)
        assert info.value.status == 422


def test_running_service_stops_the_server(bm25_index):
    with running_service(bm25_index) as url:
        assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


def test_running_service_reports_a_failed_start(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code"), running_service(tmp_path, startup_timeout=60):
        pass


def test_client_gives_up_after_bounded_retries_on_connection_errors():
    client = RetrievalClient(f"http://127.0.0.1:{free_port()}", timeout=2, max_retries=2, backoff=0.01)
    with pytest.raises(RetrievalError, match=r"failed after 3 attempt\(s\); last error: ConnectError"):
        client.search_sync(["q"])


def test_in_process_respond_equals_the_served_answer(server, bm25_index):
    from spader_pipeline.retrieval import load_retriever

    queries = ["river", "country in West Africa", "bird"]
    local = load_retriever(bm25_index).respond(queries, topk=5, max_chars=2500)
    served = RetrievalClient(server).search_sync(queries, topk=5, max_chars=2500)
    assert local == served and local.truncation_warning is not None


QUIET_SERVER = """
import os, signal, sys, threading, urllib.request

from spader_pipeline.retrieval.server import quiet_server
import uvicorn

async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

port = int(sys.argv[1])
server = quiet_server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
ticks = []
on_tick = server.on_tick
async def counted(counter):
    ticks.append(counter)
    print("exit check", flush=True)
    return await on_tick(counter)
server.on_tick = counted

def client():
    while not server.started:
        threading.Event().wait(0.05)
    answers = [urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read() for _ in range(3)]
    threading.Event().wait(1.0)  # uvicorn's own loop would tick ten times here
    print("served", answers, "ticks before the signal", len(ticks), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=client, daemon=True).start()
server.run()  # after a graceful shutdown uvicorn delivers the signal again: the process ends by it
"""


def test_an_idle_server_sleeps_until_a_signal_stops_it():
    """quiet_server: no periodic wakeups while idle (one exit check at the start, one at the signal),
    requests served meanwhile, and SIGTERM still ends it the way uvicorn does."""
    import signal
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", QUIET_SERVER, str(free_port())], capture_output=True, text=True,
                          timeout=300)
    assert "served [b'ok', b'ok', b'ok'] ticks before the signal 1" in done.stdout, done.stdout + done.stderr
    assert done.stdout.count("exit check") == 2 and done.returncode == -signal.SIGTERM, done.stdout + done.stderr
