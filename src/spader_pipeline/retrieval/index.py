"""Build an index folder from a corpus and load it back as a :class:`~.service.Searcher`.

Index folder layout::

    <out>/manifest.json      method, parameters, corpus hash, sizes, build time
    <out>/docs.jsonl         the passages, compact, one per line (row = line number)
    <out>/docs.offsets.npy   int64 [N+1] byte offsets into docs.jsonl (memory-mapped)
    <out>/bm25/ | <out>/dense/ | <out>/lucene/   the method's own files
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from spader_pipeline.retrieval.bm25 import BM25Params, BM25Retriever, build_bm25
from spader_pipeline.retrieval.bm25_sharded import build_bm25_sharded
from spader_pipeline.retrieval.corpus import (
    DOCS_FILE,
    OFFSETS_FILE,
    DocStore,
    DocStoreWriter,
    Passage,
    iter_corpus,
)
from spader_pipeline.retrieval.dense import DenseParams, DenseRetriever, build_dense
from spader_pipeline.retrieval.lucene import LuceneParams, LuceneRetriever, build_lucene
from spader_pipeline.retrieval.rerank import CrossEncoderReranker, RerankParams
from spader_pipeline.retrieval.service import Searcher

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
METHODS = ("bm25", "dense", "lucene")  # lucene: needs pyserini + Java (lucene.py)


def _tee(passages: Iterable[Passage], store: DocStoreWriter) -> Iterator[Passage]:
    for passage in passages:
        store.add(passage)
        yield passage


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_index(passages: Iterable[Passage], out_dir: str | os.PathLike, method: str = "bm25",
                params: dict[str, Any] | None = None, *, corpus_path: str | None = None,
                show_progress: bool = True) -> dict[str, Any]:
    """Stream ``passages`` once into a doc store and a ``method`` index under ``out_dir``.

    ``params`` holds the method's block (``bm25:`` / ``dense:`` keys of the config, plus an
    optional ``rerank:`` block recorded for serving). Returns the manifest (also written to
    ``out_dir/manifest.json``).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    params = dict(params or {})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    store = DocStoreWriter(out)
    try:
        if method == "bm25":
            bm25 = BM25Params.from_dict(params.get("bm25"))
            build = build_bm25 if bm25.shard_docs is None else build_bm25_sharded
            figures = build(_tee(passages, store), out / "bm25", bm25, show_progress=show_progress)
        elif method == "dense":
            dense = DenseParams.from_dict(params.get("dense"))
            figures = build_dense(_tee(passages, store), out / "dense", dense, show_progress=show_progress)
        else:
            lucene = LuceneParams.from_dict(params.get("lucene"))
            figures = build_lucene(_tee(passages, store), out / "lucene", lucene, show_progress=show_progress)
    finally:
        store.close()
    seconds = time.perf_counter() - started
    manifest = {
        "format_version": MANIFEST_VERSION,
        "method": method,
        "parameters": figures.pop("params"),
        "rerank": RerankParams.from_dict(params.get("rerank")).__dict__,
        "corpus": {"path": corpus_path, "sha256": store.sha256, "num_passages": len(store)},
        "sizes": {
            **{k: v for k, v in figures.items() if isinstance(v, int | float | str)},
            "docstore_bytes": sum((out / name).stat().st_size for name in (DOCS_FILE, OFFSETS_FILE)),
            "index_bytes": dir_bytes(out / method),
        },
        "build_seconds": round(seconds, 3),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


def build_index_from_file(corpus: str | os.PathLike, out_dir: str | os.PathLike, method: str = "bm25",
                          params: dict[str, Any] | None = None, **kwargs) -> dict[str, Any]:
    """:func:`build_index` over a JSON-lines corpus file, streamed line by line."""
    return build_index(iter_corpus(corpus), out_dir, method, params, corpus_path=str(corpus), **kwargs)


def read_manifest(index_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(index_dir) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"{index_dir} is not an index folder (no {MANIFEST_FILE})")
    return json.loads(path.read_text(encoding="utf-8"))


def load_retriever(index_dir: str | os.PathLike, *, mmap: bool | None = None,
                   rerank: dict[str, Any] | None = None, **dense_overrides) -> Searcher:
    """Open an index folder for in-process search: ``load_retriever(d).search(queries, topk)``.

    ``mmap`` overrides the stored memory-mapping choice; ``rerank`` overrides the manifest's
    reranker block (``{"model_path": ...}``); further keywords adjust dense query settings.
    """
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    method = manifest["method"]
    if method == "bm25":
        use_mmap = manifest["parameters"].get("mmap", False) if mmap is None else mmap
        retriever = BM25Retriever(index_dir / "bm25", mmap=use_mmap)
    elif method == "dense":
        retriever = DenseRetriever(index_dir / "dense", mmap=mmap, **dense_overrides)
    elif method == "lucene":
        retriever = LuceneRetriever(index_dir / "lucene")
    else:
        raise ValueError(f"index {index_dir} has unknown method {method!r}")
    rerank_params = RerankParams.from_dict({**manifest.get("rerank", {}), **(rerank or {})})
    reranker = CrossEncoderReranker(rerank_params) if rerank_params.model_path else None
    return Searcher(retriever, DocStore(index_dir), reranker=reranker, manifest=manifest,
                    rerank_by_default=rerank_params.enabled_by_default)
