"""BM25 over a streamed corpus with ``bm25s`` (Lù, 2024, arXiv 2407.03618) as the index store.

Build: passages are tokenised one by one into int32 vocabulary ids (the text itself is not kept;
build memory is ~O(tokens), see docs/retrieval.md for when to switch to Lucene);
``bm25s.BM25.index`` turns the ids into the eager sparse score matrix (CSC: one column per term,
entry = the BM25 weight of that term in that document), saved as ``.npy`` arrays.

Query: the matrix is loaded, optionally memory-mapped (``mmap: true``), and a query is scored by
summing its terms' columns. Only documents that contain a query term are ranked, as with Lucene.
Default parameters ``k1=0.9, b=0.4`` are Pyserini's, which the SPADER reference server uses.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from spader_pipeline.retrieval.bm25s_import import import_bm25s
from spader_pipeline.retrieval.corpus import Passage
from spader_pipeline.retrieval.tokenize import Tokenizer
from spader_pipeline.typed_config import from_mapping

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class BM25Params:
    """BM25 settings (``conf/base/parameters_index_build.yml`` → ``bm25``)."""

    k1: float = 0.9  #: term-frequency saturation (Pyserini default)
    b: float = 0.4  #: length normalisation (Pyserini default)
    method: str = "lucene"  #: bm25s scoring variant: lucene | robertson | atire | bm25l | bm25+
    stemmer: str | None = "english"  #: Snowball stemmer language, or null
    stopwords: str | None = "en"  #: stopword list, or null
    index_title: bool = True  #: index "title\ncontents" rather than contents alone
    mmap: bool = False  #: memory-map the score matrix at load time (for indexes larger than RAM)
    #: build in shards of this many passages with corpus-wide statistics (bounded memory, same index
    #: files and scores as the one-shot build); null: one in-memory ``bm25s`` build
    shard_docs: int | None = None

    @classmethod
    def from_dict(cls, values: dict | None) -> BM25Params:
        return from_mapping(cls, values, where="bm25")

    def __post_init__(self) -> None:
        if self.shard_docs is not None and self.shard_docs < 1:
            raise ValueError(f"shard_docs must be >= 1 or null, got {self.shard_docs}")


def passage_text(passage: Passage, with_title: bool) -> str:
    """The text that is indexed for a passage."""
    if with_title and passage.title and not passage.contents.startswith(passage.title):
        return f"{passage.title}\n{passage.contents}"
    return passage.contents


def build_bm25(passages: Iterable[Passage], out_dir: str | Path, params: BM25Params,
               *, show_progress: bool = True) -> dict:
    """Index ``passages`` (any iterable, consumed once) into ``out_dir`` in one in-memory build;
    returns size figures. ``params.shard_docs`` is :func:`.bm25_sharded.build_bm25_sharded`'s
    (:func:`spader_pipeline.retrieval.index.build_index` picks the build)."""
    bm25s = import_bm25s()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(params.stemmer, params.stopwords)
    corpus_ids: list[np.ndarray] = []  # int32 ids per passage: ~7x smaller than lists of Python ints
    n_tokens = 0
    for passage in passages:
        ids = np.asarray(tokenizer.ids(passage_text(passage, params.index_title), grow=True), dtype=np.int32)
        n_tokens += len(ids)
        corpus_ids.append(ids)
    if not corpus_ids:
        raise ValueError("cannot build a BM25 index over an empty corpus")
    vocab = dict(tokenizer.vocab)
    vocab.setdefault("", len(vocab))  # bm25s' empty-document token, never produced by the tokenizer
    model = bm25s.BM25(k1=params.k1, b=params.b, method=params.method)
    model.index(bm25s.tokenization.Tokenized(ids=corpus_ids, vocab=vocab), show_progress=show_progress)
    del corpus_ids
    model.save(str(out_dir), show_progress=False)
    (out_dir / TOKENIZER_FILE).write_text(
        json.dumps({"stemmer": params.stemmer, "stopwords": params.stopwords}),
        encoding="utf-8",
    )
    nnz = int(model.scores["data"].shape[0])
    return {"num_docs": int(model.scores["num_docs"]), "vocab_size": len(vocab), "nnz": nnz,
            "num_tokens": n_tokens, "params": asdict(params)}


class BM25Retriever:
    """Top-k BM25 search over a saved index. Thread-safe for concurrent reads."""

    name = "bm25"

    def __init__(self, index_dir: str | Path, *, mmap: bool = False) -> None:
        bm25s = import_bm25s()

        index_dir = Path(index_dir)
        model = bm25s.BM25.load(str(index_dir), mmap=mmap, load_corpus=False)
        spec = json.loads((index_dir / TOKENIZER_FILE).read_text(encoding="utf-8"))
        self.tokenizer = Tokenizer(spec["stemmer"], spec["stopwords"], model.vocab_dict)  # bm25s' vocab file
        self._data = model.scores["data"]  # [nnz] float32 BM25 weights, grouped by term
        self._indices = model.scores["indices"]  # [nnz] int32 document rows
        self._indptr = model.scores["indptr"]  # [V + 1] column starts
        self.num_docs = int(model.scores["num_docs"])
        self.mmap = mmap
        #: :meth:`search` scores a batch as one sparse product while the corpus has at most this many
        #: passages (the product allocates O(N) scratch per call); beyond it, query by query (O(postings))
        self.batch_max_docs = 2_000_000
        self._csr = None
        #: scores(): aggregate sparsely while the query's postings are below this share of the corpus
        self.sparse_fraction = 0.25
        self._local = threading.local()  # one zeroed [N] float32 accumulator per search thread

    def scores(self, query: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows that contain at least one query term and their BM25 scores: ``([M] int64, [M] float32)``.

        Sums each term's column (weighted by its count in the query). Small posting sets are
        aggregated sparsely; when they cover a large share of the corpus a dense ``[N]`` accumulator
        is cheaper.
        """
        ids, counts = self.tokenizer.query_terms(query)
        if ids.size == 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        starts, ends = self._indptr[ids], self._indptr[ids + 1]
        total = int((ends - starts).sum())
        if total == 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        if total < self.sparse_fraction * self.num_docs:
            rows = np.concatenate([self._indices[s:e] for s, e in zip(starts, ends, strict=True)])
            weights = np.concatenate(
                [self._data[s:e] * c for s, e, c in zip(starts, ends, counts, strict=True)]
            )
            uniq, inverse = np.unique(rows, return_inverse=True)
            return uniq.astype(np.int64), np.bincount(inverse, weights=weights).astype(np.float32)
        acc = np.zeros(self.num_docs, dtype=np.float32)
        for s, e, c in zip(starts, ends, counts, strict=True):
            acc[self._indices[s:e]] += self._data[s:e] * c  # rows within one column are distinct
        rows = np.flatnonzero(acc)
        return rows, acc[rows]

    def _accumulator(self) -> np.ndarray:
        acc = getattr(self._local, "acc", None)
        if acc is None:
            acc = self._local.acc = np.zeros(self.num_docs, dtype=np.float32)
        return acc

    def top(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best ``k`` rows for ``query`` and their scores, best first; same ranking as
        ``top_k(*self.scores(query), k)`` but O(postings): no pass over all N documents.

        Term columns are added into a per-thread zeroed accumulator ``[N]``; the touched entries
        are read back (a row appears once per query term it contains, so the best ``k * T``
        entries hold the best ``k`` distinct rows, and with every entry tied with the last of them
        the lowest rows among equal scores, as :func:`top_k` breaks ties) and reset to zero.
        """
        ids, counts = self.tokenizer.query_terms(query)
        if ids.size == 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        starts, ends = self._indptr[ids], self._indptr[ids + 1]
        slices = [self._indices[s:e] for s, e in zip(starts, ends, strict=True)]
        acc = self._accumulator()
        for (s, e), rows_t, c in zip(zip(starts, ends, strict=True), slices, counts, strict=True):
            acc[rows_t] += self._data[s:e] * c  # rows within one column are distinct
        rows = np.concatenate(slices) if len(slices) > 1 else np.asarray(slices[0])
        if rows.size == 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        scores = acc[rows]
        acc[rows] = 0.0
        m = k * len(slices)
        if rows.size > m:
            keep = _at_least_kth_best(scores, m)
            rows, scores = rows[keep], scores[keep]
        best: dict[int, float] = dict(zip(rows.tolist(), scores.tolist(), strict=True))  # dedupe (small)
        return top_k(np.fromiter(best.keys(), np.int64, len(best)), np.fromiter(best.values(), np.float32, len(best)), k)

    def _term_matrix(self):
        """The index as a scipy CSR matrix ``[V, N]`` (term rows), sharing the arrays (no copy)."""
        if self._csr is None:
            import scipy.sparse as sp

            indptr = self._indptr
            if indptr.dtype != self._indices.dtype and int(indptr[-1]) < 2**31:
                indptr = np.asarray(indptr, dtype=self._indices.dtype)  # [V+1], small; avoids copying indices
            self._csr = sp.csr_matrix((self._data, self._indices, indptr), shape=(len(indptr) - 1, self.num_docs))
        return self._csr

    def search(self, queries: Sequence[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query: the best ``k`` rows and scores, best first (fewer when fewer docs match).

        A batch is scored as one sparse product ``Q[B, V] @ index[V, N]`` whose row ``b`` sums, term
        by term in the same order and float32 arithmetic as :meth:`top`, the weighted postings of
        query ``b``: the same scores, with one pass of C loops for the whole batch instead of a
        dozen numpy calls per query.
        """
        if len(queries) <= 1 or self.num_docs > self.batch_max_docs or not _has_scipy():
            return [self.top(q, k) for q in queries]  # the same scores, query by query
        import scipy.sparse as sp

        index = self._term_matrix()
        bags = [self.tokenizer.query_terms(q) for q in queries]
        indptr = np.zeros(len(bags) + 1, dtype=index.indptr.dtype)
        np.cumsum([ids.size for ids, _ in bags], out=indptr[1:])
        terms = np.concatenate([ids for ids, _ in bags]).astype(index.indices.dtype)
        counts = np.concatenate([c for _, c in bags]).astype(np.float32)
        scores = sp.csr_matrix((counts, terms, indptr), shape=(len(bags), index.shape[0])) @ index
        out = []
        for b in range(len(bags)):
            s, e = scores.indptr[b], scores.indptr[b + 1]
            out.append(top_k(scores.indices[s:e].astype(np.int64), scores.data[s:e], k))
        return out


def top_k(rows: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` highest ``scores`` (ties broken by lower row, also at the cut) and their rows, best first."""
    if rows.size > k:
        keep = _at_least_kth_best(scores, k)
        rows, scores = rows[keep], scores[keep]
    order = np.lexsort((rows, -scores))[:k]
    return rows[order], scores[order]


def _at_least_kth_best(scores: np.ndarray, k: int) -> np.ndarray:
    """Which of ``scores`` (``[M]``, ``M > k``) are at least the ``k``-th best: the best ``k`` and every one
    tied with the last of them, so that ties can then go to the lower row (``argpartition`` alone would
    pick among the tied by their order)."""
    return scores >= -np.partition(-scores, k - 1)[k - 1]


@functools.cache
def _has_scipy() -> bool:
    """Whether scipy's sparse products are at hand (a project dependency; a bundle run on a machine of only
    torch and numpy searches query by query instead)."""
    try:
        import scipy.sparse  # noqa: F401
    except ImportError:
        return False
    return True
