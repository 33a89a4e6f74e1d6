"""BM25 through Lucene (Pyserini), the backend of the SPADER and Search-R1 reference servers.

Selected with ``method: lucene``. Lucene builds its index segment by segment on disk, so building
a 25M-passage Wikipedia index needs bounded memory (bm25s needs O(tokens) RAM while building; see
docs/retrieval.md). Requires ``pip install pyserini`` and a Java 21 runtime, neither of which is a
dependency of this project: without them, selecting the backend fails with a message that says so.

The passages are written as a Pyserini ``JsonCollection`` whose docids are row numbers, indexed by
``python -m pyserini.index.lucene``, and the collection is deleted afterwards; passages are served
from the index folder's own doc store, like the other methods.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from spader_pipeline.retrieval.bm25 import passage_text
from spader_pipeline.retrieval.corpus import Passage


@dataclass(frozen=True)
class LuceneParams:
    k1: float = 0.9  #: Pyserini default
    b: float = 0.4  #: Pyserini default
    threads: int = 8  #: indexing and batch-search threads
    index_title: bool = True

    @classmethod
    def from_dict(cls, values: dict | None) -> LuceneParams:
        return cls(**dict(values or {}))


def require_lucene() -> None:
    """Raise a clear error unless pyserini and a Java runtime are available."""
    missing = []
    if importlib.util.find_spec("pyserini") is None:
        missing.append("the pyserini package (pip install -c constraints.txt pyserini)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        missing.append("a Java 21 runtime (java on PATH or JAVA_HOME)")
    if missing:
        raise RuntimeError("the lucene backend needs " + " and ".join(missing)
                           + "; use method: bm25 (bm25s) where they are not installed")


def build_lucene(passages: Iterable[Passage], out_dir: str | Path, params: LuceneParams,
                 *, show_progress: bool = True) -> dict:
    require_lucene()
    out_dir = Path(out_dir)
    collection = out_dir / "collection"
    collection.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(collection / "docs.jsonl", "w", encoding="utf-8") as sink:
        for row, passage in enumerate(passages):
            sink.write(json.dumps({"id": str(row), "contents": passage_text(passage, params.index_title)},
                                  ensure_ascii=False) + "\n")
            n = row + 1
    if n == 0:
        raise ValueError("cannot build a Lucene index over an empty corpus")
    subprocess.run(
        [sys.executable, "-m", "pyserini.index.lucene", "--collection", "JsonCollection", "--input", str(collection),
         "--index", str(out_dir / "index"), "--generator", "DefaultLuceneDocumentGenerator",
         "--threads", str(params.threads)],
        check=True, stdout=None if show_progress else subprocess.DEVNULL,
    )
    shutil.rmtree(collection)
    (out_dir / "lucene.json").write_text(json.dumps(asdict(params)), encoding="utf-8")
    return {"num_docs": n, "params": asdict(params)}


class LuceneRetriever:
    """BM25 top-k from a Lucene index via ``LuceneSearcher.batch_search``; docids are rows."""

    name = "lucene"

    def __init__(self, index_dir: str | Path) -> None:
        require_lucene()
        from pyserini.search.lucene import LuceneSearcher

        index_dir = Path(index_dir)
        self.params = LuceneParams.from_dict(json.loads((index_dir / "lucene.json").read_text(encoding="utf-8")))
        self.searcher = LuceneSearcher(str(index_dir / "index"))
        self.searcher.set_bm25(self.params.k1, self.params.b)
        self.num_docs = int(self.searcher.num_docs)

    def search(self, queries: Sequence[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        qids = [str(i) for i in range(len(queries))]
        hits = self.searcher.batch_search(list(queries), qids, k=k, threads=self.params.threads)
        out = []
        for qid in qids:
            found = hits.get(qid, [])
            out.append((np.array([int(h.docid) for h in found], dtype=np.int64),
                        np.array([h.score for h in found], dtype=np.float32)))
        return out
