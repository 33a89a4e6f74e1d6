"""The OpenAI-compatible backend against a local stub server speaking the chat-completions API."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from agent_toy_data import GROUPS, QUESTIONS
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from spader_pipeline.agent.openai_backend import OpenAIChatGenerator, server_command
from spader_pipeline.agent.rollout import run_rollouts
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.retrieval import RetrievalClient


def _stub_app(log: list[dict]) -> FastAPI:
    """Turn 1: search the question; turn 2: answer every title in the observation.

    The first request of every conversation fails with 503 (clients must retry). The model name
    ``native-tools`` returns the search as an OpenAI ``tool_calls`` entry instead of text.
    """
    app = FastAPI()
    seen: set[str] = set()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        log.append(body)
        messages = body["messages"]
        key = body["model"] + messages[0]["content"] + str(len(messages))
        if key not in seen:
            seen.add(key)
            return JSONResponse({"error": "warming up"}, status_code=503)
        if body["model"] == "broken":
            return JSONResponse({"error": "bad request"}, status_code=400)
        if body["model"] == "short-context" and len(messages) > 1:
            message = "This model's maximum context length is 64 tokens. However, you requested 90 tokens."
            return JSONResponse({"object": "error", "message": message}, status_code=400)
        message: dict = {"role": "assistant", "content": "<think>searching</think>"}
        if len(messages) == 1:
            question = messages[0]["content"].rsplit("Question:", 1)[-1].strip()
            if body["model"] == "native-tools":
                args = json.dumps({"query_list": [question]})
                message["tool_calls"] = [
                    {"id": "c1", "type": "function", "function": {"name": "search", "arguments": args}}
                ]
            else:
                message["content"] += f"<tool_call>{json.dumps([question])}</tool_call>"
        else:
            titles = re.findall(r"\(Title: ([^)]*)\)", messages[-1]["content"])
            message["content"] = f"<answer>{json.dumps(sorted(set(titles)))}</answer>"
        return {
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    return app


@pytest.fixture(scope="module")
def stub_server():
    log: list[dict] = []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_stub_app(log), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        server.should_exit = True
        thread.join(timeout=10)


async def _roll(url, retrieval_url, model, samples, **kwargs):
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=64, seed=3)
    gen = OpenAIChatGenerator(url, model, sampling, concurrency=2, backoff=0.01, **kwargs)
    async with RetrievalClient(retrieval_url) as client:
        try:
            return await run_rollouts(
                samples, gen, client, RolloutConfig(topk=4), "Question: {question}"
            ), gen
        finally:
            await gen.aclose()


@pytest.mark.parametrize("model", ["text-tools", "native-tools"])
def test_chat_backend_runs_the_protocol_with_retries(stub_server, retrieval_url, model):
    url, log = stub_server
    trajectories, gen = asyncio.run(_roll(url, retrieval_url, model, QUESTIONS[:2]))
    for t in trajectories:
        assert t.finish_reason == "answer" and t.num_searches == 1
        assert t.response_ids is None  # chat backends have no token layout
    assert set(GROUPS["Country in West Africa"]) & set(trajectories[0].predicted)
    assert gen.usage["retries"] >= 4 and gen.usage["requests"] == 4
    sent = log[-1]
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"], sent["seed"]) == (0.7, 0.9, 64, 3)
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]


def test_chat_backend_failure_is_reported_not_raised(stub_server, retrieval_url):
    url, _ = stub_server
    [t], _ = asyncio.run(_roll(url, retrieval_url, "broken", QUESTIONS[:1]))
    assert t.finish_reason == "error" and "400" in t.error


def test_context_overflow_ends_the_trajectory_without_failing_it(stub_server, retrieval_url):
    url, _ = stub_server
    [t], _ = asyncio.run(_roll(url, retrieval_url, "short-context", QUESTIONS[:1]))
    assert t.finish_reason == "token_budget" and t.error is None
    assert t.num_searches == 1 and t.predicted is None


def test_chat_backend_gives_up_after_retries(retrieval_url):
    [t], gen = asyncio.run(
        _roll("http://127.0.0.1:9/v1", retrieval_url, "m", QUESTIONS[:1], max_retries=1, timeout=2)
    )
    assert t.finish_reason == "error" and gen.usage["retries"] == 1


def test_server_command_lines():
    assert server_command("vllm", "/m", 8001, "qwen")[:3] == ["vllm", "serve", "/m"]
    assert "--served-model-name" in server_command("sglang", "/m", 8001, "qwen")
    with pytest.raises(ValueError):
        server_command("tgi", "/m", 1, "x")


@pytest.mark.gpu
def test_served_tiny_checkpoint_end_to_end(tmp_path, retrieval_url):  # pragma: no cover - GPU + vLLM only
    """merge → evaluate without manual steps: serve a saved checkpoint with vLLM, roll out, stop it."""
    pytest.importorskip("vllm")
    from agent_toy_data import corpus_records

    from spader_pipeline.agent.openai_backend import served_model
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_base_model

    texts = [r["contents"] for r in corpus_records()] * 3
    model_dir = build_base_model(
        texts,
        tmp_path / "model",
        spec=TinyQwen3Spec(hidden_size=64, num_hidden_layers=2),
        vocab_size=600,
        min_frequency=1,
    )
    args = ["--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.3"]
    with served_model(model_dir, served_name="tiny", extra_args=args, log_path=tmp_path / "vllm.log") as url:
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
        trajectories, gen = asyncio.run(_roll(url, retrieval_url, "tiny", QUESTIONS))
    assert all(t.finish_reason != "error" for t in trajectories), [t.error for t in trajectories]
    assert gen.usage["completion_tokens"] > 0
    with pytest.raises(httpx.TransportError):  # the server is gone
        httpx.get(url.removesuffix("/v1") + "/health", timeout=2)
