"""The BM25 index built in bounded memory: bm25s' files from a corpus of any size (docs/retrieval.md).

Used instead of :func:`.bm25.build_bm25` (:func:`.index.build_index` picks it when
``bm25.shard_docs`` is set) for a corpus too large to index in one piece; the files and weights are
the same as bm25s' own build.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from spader_pipeline.retrieval.bm25 import TOKENIZER_FILE, BM25Params, passage_text
from spader_pipeline.retrieval.bm25s_import import import_bm25s
from spader_pipeline.retrieval.corpus import Passage
from spader_pipeline.retrieval.tokenize import Tokenizer

logger = logging.getLogger(__name__)

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
    bm25s = import_bm25s()

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
