"""How a pipeline stage reaches the retrieval index: one settings type for the warm start, native RL
rollouts and evaluation (``warm_start.search``, ``training.search``, ``evaluate.retrieval``).

``url`` names a running service; without one the stage uses the index of its ``index_manifest``,
in process (``mode: local``, the fastest) or through a service it starts for its duration
(``mode: service``). Built strictly with :func:`spader_pipeline.typed_config.from_mapping`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from spader_pipeline.typed_config import from_mapping

__all__ = ["RetrievalSettings", "retrieval_settings", "service_url"]


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

    def __post_init__(self) -> None:
        if self.mode not in ("local", "service"):
            raise ValueError(f"retrieval mode must be 'local' or 'service', got {self.mode!r}")
        if self.timeout <= 0 or self.max_retries < 0 or self.startup_timeout <= 0:
            raise ValueError("need timeout > 0, max_retries >= 0 and startup_timeout > 0")


def retrieval_settings(params: RetrievalSettings | Mapping[str, Any] | None, *, where: str) -> RetrievalSettings:
    """``params`` as :class:`RetrievalSettings` (a mapping is checked for unknown keys)."""
    if isinstance(params, RetrievalSettings):
        return params
    return from_mapping(RetrievalSettings, params, where=where)


@contextlib.contextmanager
def service_url(settings: RetrievalSettings, index_dir: str | os.PathLike) -> Iterator[str]:
    """The service URL: ``settings.url``, or a service started on ``index_dir`` for the duration
    (always stopped afterwards). ``mode: local`` is refused: the caller needs HTTP."""
    if settings.url:
        yield settings.url
        return
    if settings.mode == "local":
        raise ValueError("this stage searches over HTTP: set retrieval mode 'service' or a url")
    from spader_pipeline.retrieval.client import running_service

    with running_service(index_dir, startup_timeout=settings.startup_timeout) as url:
        yield url
