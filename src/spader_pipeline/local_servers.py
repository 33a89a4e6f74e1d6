"""Helpers for the local servers the project starts as subprocesses (retrieval service, vLLM/SGLang).

Each server runs in its own process group on a free loopback port; callers wait for ``/health``
and always stop the whole group, SIGTERM first, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_healthy(
    base_url: str,
    timeout: float,
    process: subprocess.Popen | None = None,
    *,
    name: str = "server",
    interval: float = 0.1,
) -> httpx.Response:
    """Poll ``GET {base_url}/health`` until it answers 200 and return that response.

    Fails early with ``RuntimeError`` if ``process`` exits, and with ``TimeoutError`` (naming the last
    answer) after ``timeout`` seconds. Proxies from the environment are ignored: the server is local.
    """
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode} before it was healthy")
        try:
            response = httpx.get(base_url + "/health", timeout=2.0, trust_env=False)
            if response.status_code == 200:
                return response
            last = f"HTTP {response.status_code}"
        except httpx.TransportError as err:
            last = type(err).__name__
        time.sleep(interval)
    raise TimeoutError(f"{name} at {base_url} not healthy after {timeout:.0f}s ({last})")


def stop_process_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop ``process`` and its process group (started with ``start_new_session=True``)."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace)
