"""Thin nodes around :mod:`spader_pipeline.retrieval.index`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from spader_pipeline.retrieval.corpus import Passage, iter_corpus, iter_records
from spader_pipeline.retrieval.index import build_index, load_retriever

logger = logging.getLogger(__name__)


def _passages(corpus: Any) -> Iterator[Passage]:
    """Stream passages from whatever the catalog's ``corpus`` dataset loads: a DataFrame
    (row by row, no list of dicts), a :class:`~spader_pipeline.retrieval.datasets.CorpusFile`,
    a path, or an iterable of mappings."""
    if hasattr(corpus, "itertuples"):
        return iter_records(row._asdict() for row in corpus.itertuples(index=False))
    if isinstance(corpus, str | Path):
        return iter_corpus(corpus)
    if hasattr(corpus, "path"):
        return iter(corpus)
    return iter_records(corpus)


def build_retrieval_index(corpus: Any, params: dict[str, Any]) -> dict[str, Any]:
    """Build the configured index (``params.method``) into ``params.out_dir``; return its manifest."""
    out_dir = Path(params["out_dir"]) / params["method"]
    source = getattr(corpus, "path", None) or params.get("corpus_label", "catalog:corpus")
    manifest = build_index(
        _passages(corpus), out_dir, params["method"], params, corpus_path=str(source),
        show_progress=params.get("show_progress", True),
    )
    manifest["index_dir"] = str(out_dir)
    logger.info("built %s index of %d passages in %.1fs at %s", params["method"],
                manifest["corpus"]["num_passages"], manifest["build_seconds"], out_dir)
    return manifest


def _probe_queries(searcher, n: int, seed: int) -> list[str]:
    rows = np.random.default_rng(seed).choice(len(searcher.docs), size=min(n, len(searcher.docs)), replace=False)
    queries = []
    for row in rows:
        doc = searcher.docs.get(int(row))
        queries.append(doc["title"] or " ".join(doc["contents"].split()[:8]))
    return queries


def measure_index(manifest: dict[str, Any], params: dict[str, Any]) -> dict[str, float]:
    """Build figures plus a probe: search passage titles and report latency and self-recall
    (the passage whose title was searched comes back in the top k)."""
    probe = params.get("probe", {})
    searcher = load_retriever(manifest["index_dir"])
    try:
        queries = _probe_queries(searcher, int(probe.get("num_queries", 100)), int(probe.get("seed", 0)))
        k = int(probe.get("topk", 5))
        latencies, found = [], 0
        for query in queries:
            started = time.perf_counter()
            result = searcher.search([query], k)[0]
            latencies.append(time.perf_counter() - started)
            found += any(d.title == query for d in result.documents)
    finally:
        searcher.close()
    sizes = manifest["sizes"]
    return {
        "build_seconds": float(manifest["build_seconds"]),
        "num_passages": float(manifest["corpus"]["num_passages"]),
        "index_mb": sizes["index_bytes"] / 1e6,
        "docstore_mb": sizes["docstore_bytes"] / 1e6,
        "probe_latency_ms_p50": float(np.median(latencies) * 1e3),
        "probe_title_recall_at_k": found / max(len(queries), 1),
    }


