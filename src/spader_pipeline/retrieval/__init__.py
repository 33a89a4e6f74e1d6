"""Retrieval: index building (BM25 via bm25s, dense via faiss), an HTTP search service that
serves both the Search-R1/VERL and the SPADER clients, and the client side (docs/retrieval.md).

Heavy modules (faiss, sentence-transformers, uvicorn) are imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spader_pipeline.retrieval.client import RetrievalClient, RetrievalError, running_service
from spader_pipeline.retrieval.schemas import Document, QueryResult, SearchResponse, ServiceSettings

if TYPE_CHECKING:
    from spader_pipeline.retrieval.index import build_index, build_index_from_file, load_retriever
    from spader_pipeline.retrieval.server import create_app

__all__ = [
    "Document", "QueryResult", "RetrievalClient", "RetrievalError", "SearchResponse", "ServiceSettings",
    "build_index", "build_index_from_file", "create_app", "load_retriever", "running_service",
]


def __getattr__(name: str):
    if name in ("build_index", "build_index_from_file", "load_retriever"):
        from spader_pipeline.retrieval import index

        return getattr(index, name)
    if name == "create_app":
        from spader_pipeline.retrieval.server import create_app

        return create_app
    raise AttributeError(name)
