"""How a pipeline stage reaches the retrieval index: one settings type for the warm start, native RL
rollouts, the VERL launch and evaluation (``warm_start.search``, ``training.search``,
``training.verl.retrieval``, ``evaluate.retrieval``).

``url`` names a running service; without one the stage uses the index of its ``index_manifest``,
in process (``mode: local``, the fastest) or through a service it starts for its duration
(``mode: service``), listening on ``bind_host``:``port`` and reached by clients at
``advertised_host`` (clients on other machines, e.g. VERL's agent-loop workers on several nodes).
Built strictly with :func:`spader_pipeline.typed_config.from_mapping`.

The two functions here are the one place that choice is made: :func:`search_backend` for a stage
that searches itself (rollouts: in process or over HTTP), :func:`service_url` for one that hands a
URL on (evaluation's clients, VERL's search tool).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from spader_pipeline.typed_config import from_mapping

__all__ = ["RetrievalSettings", "retrieval_settings", "search_backend", "service_url"]

#: bind addresses that mean "every interface" (no client can use them as an address)
WILDCARD_HOSTS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class RetrievalSettings:
    """Where searches go and how the client behaves."""

    url: str | None = None
    """base URL of a running retrieval service; ``None``: use the stage's index (see ``mode``)"""
    mode: Literal["local", "service"] = "service"
    """without ``url``: ``local`` searches the index in process, ``service`` starts the HTTP service on it"""
    timeout: float = 30.0
    """seconds per request"""
    max_retries: int = 3
    """retries of a failed request (with backoff) before the search counts as failed"""
    startup_timeout: float = 180.0
    """seconds a started service may take to load the index"""
    bind_host: str = "127.0.0.1"
    """interface a started service listens on (``0.0.0.0``: every interface, for other machines)"""
    advertised_host: str | None = None
    """the address clients reach a started service at; ``None``: ``bind_host`` (a wildcard needs one)"""
    port: int | None = None
    """port of a started service; ``None``: a free one"""

    def __post_init__(self) -> None:
        if self.mode not in ("local", "service"):
            raise ValueError(f"retrieval mode must be 'local' or 'service', got {self.mode!r}")
        if self.timeout <= 0 or self.max_retries < 0 or self.startup_timeout <= 0:
            raise ValueError("need timeout > 0, max_retries >= 0 and startup_timeout > 0")
        if not self.url and self.bind_host in WILDCARD_HOSTS and not self.advertised_host:
            raise ValueError(f"a service bound to {self.bind_host} needs advertised_host: the address clients use")

    def advertised_url(self, port: int) -> str:
        """Base URL clients use for a service this stage starts on ``port``."""
        host = self.advertised_host or self.bind_host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def retrieval_settings(params: RetrievalSettings | Mapping[str, Any] | None, *, where: str) -> RetrievalSettings:
    """``params`` as :class:`RetrievalSettings` (a mapping is checked for unknown keys)."""
    if isinstance(params, RetrievalSettings):
        return params
    return from_mapping(RetrievalSettings, params, where=where)


@contextlib.contextmanager
def service_url(
    settings: RetrievalSettings, index_dir: str | os.PathLike | None, *, check: Callable[[str], object] | None = None
) -> Iterator[str]:
    """The service URL: ``settings.url``, or the advertised URL of a service started on ``index_dir``
    for the duration (always stopped afterwards). ``mode: local`` is refused: the caller needs HTTP.

    ``check(url)`` runs before anything starts; it raises for a URL the caller's clients cannot use.
    """
    if settings.url:
        if check is not None:
            check(settings.url)
        yield settings.url
        return
    if settings.mode == "local":
        raise ValueError("this stage searches over HTTP: set retrieval mode 'service' or a url")
    if index_dir is None:
        raise ValueError("no retrieval url is set and the index manifest names no index_dir to serve")
    from spader_pipeline.local_servers import free_port
    from spader_pipeline.retrieval.client import running_service

    port = settings.port or free_port(settings.bind_host)
    if check is not None:
        check(settings.advertised_url(port))
    with running_service(index_dir, host=settings.bind_host, port=port, startup_timeout=settings.startup_timeout):
        yield settings.advertised_url(port)


@contextlib.contextmanager
def search_backend(
    params: RetrievalSettings | Mapping[str, Any] | None, index_dir: str | os.PathLike, *, where: str
) -> Iterator[Any]:
    """What a rollout searches with: a :class:`~spader_pipeline.retrieval.client.RetrievalClient` on
    :func:`service_url` (``url`` or ``mode: service``), or the index in process (``mode: local``,
    :class:`~spader_pipeline.retrieval.service.LocalSearch`); closed afterwards. ``params`` is read
    by :func:`retrieval_settings` (``where`` names the block in errors)."""
    settings = retrieval_settings(params, where=where)
    if settings.url or settings.mode == "service":
        from spader_pipeline.retrieval.client import RetrievalClient

        with service_url(settings, index_dir) as url:
            yield RetrievalClient(url, timeout=settings.timeout, max_retries=settings.max_retries)
        return
    from spader_pipeline.retrieval.index import load_retriever
    from spader_pipeline.retrieval.service import LocalSearch

    retriever = load_retriever(index_dir)
    try:
        yield LocalSearch(retriever)
    finally:
        close = getattr(retriever, "close", None)
        if close is not None:
            close()
