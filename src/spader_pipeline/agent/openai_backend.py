"""Generator for any OpenAI-compatible chat endpoint (vLLM, SGLang, hosted APIs), plus a local server.

:class:`OpenAIChatGenerator` sends the whole message history to ``POST {base_url}/chat/completions``
per turn — what evaluating a served checkpoint (e.g. the released ``qwen3-8b-spader``) needs.
Requests run concurrently, bounded by a semaphore; 429/5xx answers and transport errors are retried
with exponential backoff; a turn that still fails becomes a ``GeneratedTurn`` with ``error`` set, so
the caller can retry the sample and count it (never silently dropped).

:func:`served_model` starts ``vllm serve`` (or SGLang) for a merged checkpoint on a free local port,
waits for ``/health`` and always stops the server (GPU machines only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from spader_pipeline.agent.protocol import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from spader_pipeline.agent.types import GeneratedTurn, Generator, RolloutState, SamplingParams
from spader_pipeline.local_servers import free_port, stop_process_group, wait_healthy

logger = logging.getLogger(__name__)

_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
_CONTEXT_ERROR = re.compile(
    r"context length|context window|maximum context|too many tokens|prompt is too long", re.I
)


class ContextLengthExceeded(RuntimeError):
    """The server refused the request because the conversation no longer fits the model."""


class OpenAIChatGenerator(Generator):
    """Assistant turns from an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        base_url: e.g. ``http://127.0.0.1:8001/v1``.
        model: the served model name.
        sampling: decoding parameters (``max_new_tokens`` is sent as ``max_tokens``).
        concurrency: most requests in flight at once (across all trajectories).
        max_retries: retries per request after the first attempt.
        backoff: first retry delay in seconds (doubles each retry).
        timeout: seconds per request.
        api_key: sent as a bearer token (``EMPTY`` for local servers).
        extra_body: merged into every request (e.g. ``{"chat_template_kwargs": {"enable_thinking": false}}``).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        sampling: SamplingParams | None = None,
        *,
        concurrency: int = 8,
        max_retries: int = 3,
        backoff: float = 0.5,
        timeout: float = 300.0,
        api_key: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.sampling = sampling or SamplingParams()
        self.max_retries = max_retries
        self.backoff = backoff
        self.timeout = timeout
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")
        self.extra_body = dict(extra_body or {})
        self.concurrency = concurrency
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._client: httpx.AsyncClient | None = None
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0, "retries": 0}

    def _payload(self, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        s = self.sampling
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if s.top_k > 0:
            payload["top_k"] = s.top_k  # vLLM/SGLang extension
        if s.seed is not None:
            payload["seed"] = s.seed
        payload.update(self.extra_body)
        return payload

    def _client_for_loop(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        # The client and the semaphore belong to one event loop; make new ones for a new loop.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.concurrency)
            self._client = httpx.AsyncClient(
                timeout=self.timeout, headers={"Authorization": f"Bearer {self.api_key}"}
            )
        assert self._semaphore is not None
        return self._client, self._semaphore

    async def complete(self, messages: Sequence[Mapping[str, str]]) -> str:
        """One chat completion with retries; raises the last error when every attempt fails."""
        client, semaphore = self._client_for_loop()
        payload = self._payload(messages)
        delay = self.backoff
        for attempt in range(self.max_retries + 1):
            try:
                async with semaphore:
                    response = await client.post(self.url, json=payload)
                if response.status_code in _RETRY_STATUS and attempt < self.max_retries:
                    raise httpx.HTTPStatusError(
                        f"retryable status {response.status_code}",
                        request=response.request,
                        response=response,
                    )
                response.raise_for_status()
                return self._content(response.json())
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
                if status == 400 and _CONTEXT_ERROR.search(exc.response.text):
                    raise ContextLengthExceeded(exc.response.text[:300]) from exc
                if attempt >= self.max_retries or (status is not None and status not in _RETRY_STATUS):
                    raise
                self.usage["retries"] += 1
                logger.info("chat request failed (%s); retry %d in %.1fs", exc, attempt + 1, delay)
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _content(self, body: Mapping[str, Any]) -> str:
        self.usage["requests"] += 1
        for key in ("prompt_tokens", "completion_tokens"):
            self.usage[key] += int((body.get("usage") or {}).get(key) or 0)
        choices = body.get("choices") or []
        if not choices:
            raise ValueError(f"chat response has no choices: {str(body)[:200]}")
        message = choices[0].get("message") or {}
        content = message.get("content") or ""
        # Servers started with a tool parser move tool calls out of the text; put them back in the
        # protocol's form so the turn parses the same way.
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with contextlib.suppress(ValueError):
                    arguments = json.loads(arguments)
            body_json = json.dumps({"name": function.get("name", "search"), "arguments": arguments})
            content += f"\n{TOOL_CALL_OPEN}{body_json}{TOOL_CALL_CLOSE}"
        return content

    async def generate(self, states: Sequence[RolloutState]) -> list[GeneratedTurn]:
        async def one(state: RolloutState) -> GeneratedTurn:
            try:
                return GeneratedTurn(text=await self.complete(state.messages))
            except ContextLengthExceeded as exc:
                logger.info("conversation no longer fits the served model: %s", exc)
                return GeneratedTurn(text="", out_of_context=True)
            except Exception as exc:  # noqa: BLE001 - reported per trajectory, retried by the caller
                return GeneratedTurn(text="", error=f"{exc.__class__.__name__}: {exc}")

        return list(await asyncio.gather(*(one(s) for s in states)))

    async def aclose(self) -> None:
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None


# --------------------------------------------------------------------------------------------------
# A local inference server for a merged checkpoint (GPU machines)
# --------------------------------------------------------------------------------------------------


def server_command(
    engine: str, model_path: str | Path, port: int, served_name: str, extra_args: Sequence[str] = ()
) -> list[str]:
    """The command line that serves ``model_path`` with an OpenAI-compatible API on 127.0.0.1."""
    launchers = {"vllm": ["vllm", "serve", str(model_path)],
                 "sglang": ["python", "-m", "sglang.launch_server", "--model-path", str(model_path)]}
    if engine not in launchers:
        raise ValueError(f"engine must be 'vllm' or 'sglang', got {engine!r}")
    if any(a.startswith("--trust-remote-code") for a in extra_args):
        raise ValueError("--trust-remote-code is refused: a served checkpoint must not run its own code")
    from spader_pipeline.modeling.base_model import check_safe_weights

    check_safe_weights(model_path)
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
              "--load-format", "safetensors"]
    return launchers[engine] + common + list(extra_args)


@contextlib.contextmanager
def served_model(
    model_path: str | Path,
    *,
    engine: str = "vllm",
    served_name: str = "model",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout: float = 900.0,
    log_path: str | Path | None = None,
) -> Iterator[str]:
    """Serve ``model_path`` locally for the duration of the ``with`` block; yields the ``/v1`` base URL.

    The server runs in its own process group and is always stopped (SIGTERM, then SIGKILL).
    """
    port = port or free_port()
    cmd = server_command(engine, model_path, port, served_name, extra_args)
    logger.info("starting inference server: %s", shlex.join(cmd))
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, startup_timeout, process, name="inference server", interval=1.0)
        yield f"{root}/v1"
    finally:
        stop_process_group(process, grace=20.0)
        if log is not subprocess.DEVNULL:
            log.close()
