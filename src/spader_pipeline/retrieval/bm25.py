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

import json
import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

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
    """Index ``passages`` (any iterable, consumed once) into ``out_dir``; returns size figures."""
    if params.shard_docs is not None:
        return build_bm25_sharded(passages, out_dir, params, show_progress=show_progress)
    import bm25s

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



# --------------------------------------------------------------------------------------------
# Sharded build: bm25s' index, built in bounded memory
# --------------------------------------------------------------------------------------------
#
# BM25 weights need two corpus-wide statistics, document frequencies and the average document
# length, so a shard cannot be scored on its own. Pass 1 streams the corpus once, tokenises it and
# keeps per shard only its (document, term, tf) triples on disk, while summing the global document
# frequencies and lengths. Pass 2 scores each shard with the global statistics (the same float
# operations as bm25s' ``lucene`` variant, so the weights are bit-identical) and sorts it by term.
# Pass 3 merges the shards column block by column block into bm25s' CSC files with plain file
# writes. Peak memory ~ one shard's postings (plus the vocabulary), independent of the corpus size.

_MERGE_BLOCK = 8_000_000  # postings per merge block (~64 MB of data + indices + positions)


def _shard_postings(ids: list[np.ndarray], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (document, term) pairs of a shard, sorted by document then term, and their counts."""
    if not ids or int(lengths.sum()) == 0:
        empty = np.empty(0, np.int32)
        return empty, empty, empty
    key = np.repeat(np.arange(len(ids), dtype=np.int64), lengths) << 32
    key |= np.concatenate(ids).astype(np.int64)
    key.sort()
    first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    tf = np.diff(np.append(first, key.size)).astype(np.int32)
    key = key[first]
    return (key >> 32).astype(np.int32), (key & 0xFFFFFFFF).astype(np.int32), tf


def _npy_data_offset(path: Path) -> int:
    with open(path, "rb") as handle:
        version = np.lib.format.read_magic(handle)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        read_header(handle)
        return handle.tell()


def _read_range(path: Path, offset: int, dtype, start: int, stop: int) -> np.ndarray:
    """``np.load(path)[start:stop]`` with a plain read (no mapping: pages are not kept resident)."""
    with open(path, "rb") as handle:
        handle.seek(offset + start * np.dtype(dtype).itemsize)
        return np.fromfile(handle, dtype=dtype, count=stop - start)


def _lucene_idf(df: np.ndarray, n_docs: int) -> np.ndarray:
    """float32 ``[V]``: ``log(1 + (N − df + 0.5)/(df + 0.5))`` where ``df > 0`` (bm25s' lucene idf,
    evaluated with ``math.log`` on each distinct df, exactly as bm25s does per term)."""
    idf = np.zeros(df.shape[0], dtype=np.float32)
    present = df > 0
    values, inverse = np.unique(df[present], return_inverse=True)
    table = np.array([math.log(1 + (n_docs - int(d) + 0.5) / (int(d) + 0.5)) for d in values], dtype=np.float64)
    idf[present] = table[inverse]
    return idf


def build_bm25_sharded(passages: Iterable[Passage], out_dir: str | Path, params: BM25Params,
                       *, show_progress: bool = True) -> dict:
    """:func:`build_bm25` in shards of ``params.shard_docs`` passages (see the section comment).

    Writes the same files as the one-shot build (bm25s' CSC arrays, vocabulary and parameters), with
    identical BM25 weights, so loading and querying do not change.
    """
    import bm25s

    if params.method != "lucene":
        raise ValueError(f"the sharded build implements bm25s' 'lucene' scoring only, got {params.method!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "_shards"
    work.mkdir(exist_ok=True)
    tokenizer = Tokenizer(params.stemmer, params.stopwords)
    shard_docs = int(params.shard_docs or 1)
    df = np.zeros(0, dtype=np.int64)
    shard_sizes: list[int] = []
    n_docs = n_tokens = 0
    ids: list[np.ndarray] = []

    def flush() -> None:
        nonlocal df
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        doc, term, tf = _shard_postings(ids, lengths)
        vocab_size = len(tokenizer.vocab)
        df = np.concatenate([df, np.zeros(vocab_size - df.shape[0], np.int64)])
        df += np.bincount(term, minlength=vocab_size)
        k = len(shard_sizes)
        for name, array in (("doc", doc), ("term", term), ("tf", tf), ("len", lengths.astype(np.int32))):
            np.save(work / f"{k}.{name}.npy", array)
        shard_sizes.append(len(ids))
        ids.clear()
        logger.info("bm25 shard %d: %d passages tokenised", k, shard_sizes[-1])

    # Pass 1: tokenise, spill each shard's postings, accumulate global statistics.
    for passage in passages:
        token_ids = np.asarray(tokenizer.ids(passage_text(passage, params.index_title), grow=True), dtype=np.int32)
        n_tokens += len(token_ids)
        ids.append(token_ids)
        n_docs += 1
        if len(ids) == shard_docs:
            flush()
    if ids:
        flush()
    if n_docs == 0:
        raise ValueError("cannot build a BM25 index over an empty corpus")
    if n_docs >= 2**31:
        raise ValueError("more than 2^31 passages do not fit bm25s' int32 document rows")
    vocab = dict(tokenizer.vocab)
    vocab.setdefault("", len(vocab))  # bm25s' empty-document token, as in the one-shot build
    n_vocab = len(vocab)
    df = np.concatenate([df, np.zeros(n_vocab - df.shape[0], np.int64)])
    avg_doc_len = n_tokens / n_docs  # = bm25s' mean of the document lengths (an exact integer sum)
    idf = _lucene_idf(df, n_docs)
    k1, b = params.k1, params.b

    # Pass 2: score each shard with the global statistics; sort its postings by term (CSC).
    indptr = np.zeros(n_vocab + 1, dtype=np.int64)  # global column starts, summed over the shards
    offset = 0
    for k, size in enumerate(shard_sizes):
        doc = np.load(work / f"{k}.doc.npy")
        term = np.load(work / f"{k}.term.npy")
        tf = np.load(work / f"{k}.tf.npy")
        length = np.load(work / f"{k}.len.npy")
        weights = np.empty(doc.shape[0], dtype=np.float32)
        for s in range(0, doc.shape[0], _MERGE_BLOCK):  # bounded float64 temporaries
            e = min(s + _MERGE_BLOCK, doc.shape[0])
            l_d = length[doc[s:e]].astype(np.float64)
            tf_d = tf[s:e].astype(np.float32).astype(np.float64)  # bm25s counts in float32
            tfc = tf_d / (k1 * ((1 - b) + b * l_d / avg_doc_len) + tf_d)  # bm25s _score_tfc_robertson
            weights[s:e] = idf[term[s:e]].astype(np.float64) * tfc
        del tf, length
        order = np.argsort(term, kind="stable")  # by term; documents stay ascending within a term
        np.save(work / f"{k}.data.npy", weights[order])
        del weights
        np.save(work / f"{k}.rows.npy", (doc[order].astype(np.int64) + offset).astype(np.int32))
        own = np.zeros(n_vocab + 1, dtype=np.int64)
        np.cumsum(np.bincount(term, minlength=n_vocab), out=own[1:])
        np.save(work / f"{k}.indptr.npy", own)  # on disk: [V+1] per shard adds up for large vocabularies
        indptr += own
        del own
        for name in ("doc", "term", "tf", "len"):
            (work / f"{k}.{name}.npy").unlink()
        del doc, term, order
        offset += size

    # Pass 3: merge the shards' columns into one CSC, block by block, with sequential writes.
    nnz = int(indptr[-1])
    model = bm25s.BM25(k1=params.k1, b=params.b, method=params.method)
    model.scores = {"data": np.zeros(0, np.float32), "indices": np.zeros(0, np.int32),
                    "indptr": np.zeros(1, np.int64), "num_docs": n_docs}
    model.vocab_dict = vocab
    model.nonoccurrence_array = None  # lucene scoring has none
    model.save(str(out_dir), show_progress=False)  # parameters and vocabulary in bm25s' own format
    np.save(out_dir / "indptr.csc.index.npy", indptr)
    data_files = [work / f"{k}.data.npy" for k in range(len(shard_sizes))]
    row_files = [work / f"{k}.rows.npy" for k in range(len(shard_sizes))]
    indptr_files = [work / f"{k}.indptr.npy" for k in range(len(shard_sizes))]
    data_off = [_npy_data_offset(f) for f in data_files]
    row_off = [_npy_data_offset(f) for f in row_files]
    indptr_off = [_npy_data_offset(f) for f in indptr_files]
    bounds = np.unique(np.concatenate([
        np.searchsorted(indptr, np.arange(0, nnz, _MERGE_BLOCK), side="right") - 1, [n_vocab]]))
    bounds = bounds[bounds >= 0]
    with open(out_dir / "data.csc.index.npy", "wb") as fd, open(out_dir / "indices.csc.index.npy", "wb") as fi:
        for handle, dtype in ((fd, "<f4"), (fi, "<i4")):
            np.lib.format.write_array_header_1_0(handle, {"descr": dtype, "fortran_order": False, "shape": (nnz,)})
        for v0, v1 in zip(bounds[:-1], bounds[1:], strict=True):
            base = indptr[v0]
            block_data = np.empty(int(indptr[v1] - base), dtype=np.float32)
            block_rows = np.empty(block_data.shape[0], dtype=np.int32)
            before = np.zeros(v1 - v0, dtype=np.int64)  # entries of earlier shards in each column
            for k, (own_file, own_off) in enumerate(zip(indptr_files, indptr_off, strict=True)):
                own = _read_range(own_file, own_off, np.int64, v0, v1 + 1)  # this block's column starts
                counts = np.diff(own)
                start, stop = int(own[0]), int(own[-1])
                if stop > start:
                    column_start = np.repeat(indptr[v0:v1] - base + before, counts)
                    within = np.arange(stop - start) - np.repeat(own[:-1] - start, counts)
                    pos = column_start + within
                    block_data[pos] = _read_range(data_files[k], data_off[k], np.float32, start, stop)
                    block_rows[pos] = _read_range(row_files[k], row_off[k], np.int32, start, stop)
                before += counts
            block_data.tofile(fd)
            block_rows.tofile(fi)
    for f in (*data_files, *row_files, *indptr_files):
        f.unlink()
    work.rmdir()
    (out_dir / TOKENIZER_FILE).write_text(
        json.dumps({"stemmer": params.stemmer, "stopwords": params.stopwords}), encoding="utf-8"
    )
    return {"num_docs": n_docs, "vocab_size": n_vocab, "nnz": nnz, "num_tokens": n_tokens,
            "num_shards": len(shard_sizes), "params": asdict(params)}


class BM25Retriever:
    """Top-k BM25 search over a saved index. Thread-safe for concurrent reads."""

    name = "bm25"

    def __init__(self, index_dir: str | Path, *, mmap: bool = False) -> None:
        import bm25s

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
        entries hold the best ``k`` distinct rows) and reset to zero.
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
            keep = np.argpartition(-scores, m - 1)[:m]
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
        if len(queries) <= 1 or self.num_docs > self.batch_max_docs:
            return [self.top(q, k) for q in queries]
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
    """The ``k`` highest ``scores`` (ties broken by lower row) and their rows, best first."""
    if rows.size > k:
        part = np.argpartition(-scores, k - 1)[:k]
        rows, scores = rows[part], scores[part]
    order = np.lexsort((rows, -scores))
    return rows[order], scores[order]
