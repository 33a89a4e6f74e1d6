"""BM25 index over the fixture corpus: relevance, persistence, memory mapping, manifest."""

from __future__ import annotations

import json

import numpy as np
import pytest
from retrieval_cases import EXPECTED

from spader_pipeline.retrieval.bm25 import BM25Retriever, top_k
from spader_pipeline.retrieval.corpus import file_sha256, iter_corpus
from spader_pipeline.retrieval.index import build_index, build_index_from_file, load_retriever, read_manifest


@pytest.mark.parametrize(("query", "title"), sorted(EXPECTED.items()))
def test_expected_passage_in_top3(bm25_index, query, title):
    searcher = load_retriever(bm25_index)
    result = searcher.search([query], topk=3)[0]
    assert title in [d.title for d in result.documents]
    scores = [d.score for d in result.documents]
    assert scores == sorted(scores, reverse=True)


def test_mmap_load_matches_in_memory(bm25_index):
    queries = list(EXPECTED)
    in_ram = load_retriever(bm25_index, mmap=False).search(queries, topk=5)
    mapped = load_retriever(bm25_index, mmap=True)
    assert isinstance(mapped.retriever._data, np.memmap)
    assert mapped.search(queries, topk=5) == in_ram


def test_query_without_known_terms_returns_nothing(bm25_index):
    searcher = load_retriever(bm25_index)
    assert searcher.search(["zzzqx", "the of a"], topk=5)[0].documents == []


def test_only_matching_passages_are_returned(bm25_index):
    # "Accra" appears in exactly one passage: asking for 5 gives 1.
    docs = load_retriever(bm25_index).search(["Accra"], topk=5)[0].documents
    assert [d.title for d in docs] == ["Ghana"]


def test_manifest_records_method_parameters_hash_and_sizes(bm25_index, corpus_path):
    manifest = read_manifest(bm25_index)
    assert manifest["method"] == "bm25"
    assert manifest["parameters"]["k1"] == 0.9 and manifest["parameters"]["b"] == 0.4
    assert manifest["corpus"]["num_passages"] == sum(1 for _ in iter_corpus(corpus_path))
    assert len(manifest["corpus"]["sha256"]) == 64
    assert manifest["sizes"]["index_bytes"] > 0 and manifest["sizes"]["docstore_bytes"] > 0
    assert manifest["build_seconds"] >= 0
    assert len(file_sha256(corpus_path)) == 64


def test_parameters_come_from_config(tmp_path, corpus_path):
    build_index_from_file(corpus_path, tmp_path / "a", "bm25", {"bm25": {"k1": 0.9, "b": 0.4}}, show_progress=False)
    build_index_from_file(corpus_path, tmp_path / "b", "bm25", {"bm25": {"k1": 2.0, "b": 1.0}}, show_progress=False)
    a = load_retriever(tmp_path / "a").search(["river Danube Vienna"], 3)[0].documents
    b = load_retriever(tmp_path / "b").search(["river Danube Vienna"], 3)[0].documents
    assert a[0].title == b[0].title == "Danube"
    assert a[0].score != pytest.approx(b[0].score)
    assert read_manifest(tmp_path / "b")["parameters"]["k1"] == 2.0
    with pytest.raises(ValueError, match="unknown bm25 settings"):
        build_index_from_file(corpus_path, tmp_path / "c", "bm25", {"bm25": {"k_one": 1}}, show_progress=False)


def test_identical_corpus_gives_identical_hash(tmp_path, corpus_path):
    first = build_index_from_file(corpus_path, tmp_path / "x", "bm25", show_progress=False)
    second = build_index_from_file(corpus_path, tmp_path / "y", "bm25", show_progress=False)
    assert first["corpus"]["sha256"] == second["corpus"]["sha256"]


def test_streamed_build_consumes_a_generator_once(tmp_path):
    from spader_pipeline.retrieval.corpus import Passage

    consumed = []

    def passages():
        for i in range(500):
            consumed.append(i)
            yield Passage(f"p{i}", f"title {i}", f"passage number {i} about topic{i % 7}")

    manifest = build_index(passages(), tmp_path, "bm25", show_progress=False)
    assert consumed == list(range(500)) and manifest["corpus"]["num_passages"] == 500
    docs = load_retriever(tmp_path).search(["topic3"], 100)[0].documents
    assert len(docs) == len([i for i in range(500) if i % 7 == 3][:100])


def test_empty_corpus_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty corpus"):
        build_index([], tmp_path, "bm25", show_progress=False)


def test_top_k_orders_by_score_then_row():
    rows = np.array([5, 3, 9, 1])
    scores = np.array([1.0, 2.0, 2.0, 0.5], dtype=np.float32)
    r, s = top_k(rows, scores, 3)
    assert r.tolist() == [3, 9, 5] and s.tolist() == [2.0, 2.0, 1.0]


@pytest.mark.parametrize("query", ["kingfisher birds river fish", "the capital city", "Accra"])
def test_sparse_and_dense_aggregation_agree(bm25_index, query):
    retriever = BM25Retriever(bm25_index / "bm25")
    retriever.sparse_fraction = float("inf")
    sparse_rows, sparse_scores = retriever.scores(query)
    retriever.sparse_fraction = 0.0
    dense_rows, dense_scores = retriever.scores(query)
    assert sparse_rows.tolist() == dense_rows.tolist()
    np.testing.assert_allclose(sparse_scores, dense_scores, rtol=1e-6)


def test_manifest_file_is_plain_json_matching_the_files_on_disk(bm25_index, corpus_path):
    """The manifest is readable without our code (plain JSON) and its sizes are the files' sizes."""
    manifest = json.loads((bm25_index / "manifest.json").read_text())
    assert manifest == read_manifest(bm25_index) and manifest["corpus"]["path"] == str(corpus_path)
    on_disk = sum(f.stat().st_size for f in (bm25_index / "bm25").rglob("*") if f.is_file())
    assert manifest["sizes"]["index_bytes"] == on_disk


def test_top_matches_full_scoring(bm25_index):
    retriever = BM25Retriever(bm25_index / "bm25")
    for query in [*EXPECTED, "the river and the country", "Accra Accra Ghana", "zzz"]:
        for k in (1, 3, 10, 50):
            rows, scores = retriever.top(query, k)
            ref_rows, ref_scores = top_k(*retriever.scores(query), k)
            np.testing.assert_allclose(scores, ref_scores, rtol=1e-6)
            assert set(rows.tolist()) == set(ref_rows.tolist()) or np.unique(ref_scores).size < ref_scores.size
    assert not retriever._accumulator().any()  # the per-thread accumulator is left zeroed


# ----------------------------------------------------------------------------- sharded build (issue 12)


def _synthetic_passages(n: int, seed: int = 0):
    from spader_pipeline.retrieval.corpus import Passage

    rng = np.random.default_rng(seed)
    words = [f"word{i}" for i in range(300)] + ["river", "city", "the", "and"]
    for i in range(n):
        k = 0 if i % 97 == 5 else int(rng.integers(1, 60))  # some passages index no token at all
        text = " ".join(rng.choice(words, size=k, p=None)) if k else "!!"
        yield Passage(f"p{i}", f"title{i % 13}" if i % 3 else "", text)


@pytest.mark.parametrize("shard_docs", [7, 128, 5000])
def test_sharded_build_writes_the_one_shot_index_bit_for_bit(tmp_path, shard_docs):
    """Global document frequencies and lengths: every BM25 weight equals bm25s' own build, so the
    top-k of every query is identical (scores included), whatever the shard size."""
    one = tmp_path / "one"
    sharded = tmp_path / "sharded"
    build_index(_synthetic_passages(1500), one, "bm25", show_progress=False)
    manifest = build_index(
        _synthetic_passages(1500), sharded, "bm25", {"bm25": {"shard_docs": shard_docs}}, show_progress=False
    )
    assert manifest["sizes"]["num_shards"] == -(-1500 // shard_docs)
    for name in ("data", "indices", "indptr"):
        a = np.load(one / "bm25" / f"{name}.csc.index.npy")
        b = np.load(sharded / "bm25" / f"{name}.csc.index.npy")
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for name in ("vocab.index.json", "params.index.json"):
        assert json.loads((one / "bm25" / name).read_text()) == json.loads((sharded / "bm25" / name).read_text())
    assert not (sharded / "bm25" / "_shards").exists()
    queries = ["word1 word2 river", "city", "word7 word7 word250", "the and", "zzz"]
    assert load_retriever(sharded).search(queries, 10) == load_retriever(one).search(queries, 10)


def test_sharded_build_validates_its_parameters(tmp_path):
    with pytest.raises(ValueError, match="shard_docs"):
        build_index(_synthetic_passages(10), tmp_path / "a", "bm25", {"bm25": {"shard_docs": 0}}, show_progress=False)
    with pytest.raises(ValueError, match="lucene"):
        build_index(_synthetic_passages(10), tmp_path / "b", "bm25", {"bm25": {"shard_docs": 5, "method": "bm25l"}},
                    show_progress=False)
    with pytest.raises(ValueError, match="empty corpus"):
        build_index([], tmp_path / "c", "bm25", {"bm25": {"shard_docs": 5}}, show_progress=False)


def test_batched_search_equals_query_by_query(bm25_index):
    """One sparse product for a batch gives each query the rows and scores of :meth:`top` (same float32
    sums; ties broken by the lower row both ways, also among passages tied with the last kept score)."""
    retriever = BM25Retriever(bm25_index / "bm25")
    queries = [*EXPECTED, "the river and the country", "Accra Accra Ghana", "zzz", "city"]
    for k in (1, 3, 10, 50):
        batched = retriever.search(queries, k)
        for query, (rows, scores) in zip(queries, batched, strict=True):
            ref_rows, ref_scores = retriever.top(query, k)
            np.testing.assert_array_equal(scores, ref_scores)
            np.testing.assert_array_equal(rows, ref_rows)
        retriever.batch_max_docs = 0  # the query-by-query path: same scores
        for (_, s), (_, ref) in zip(retriever.search(queries, k), batched, strict=True):
            np.testing.assert_array_equal(s, ref)
        retriever.batch_max_docs = 2_000_000


def test_without_scipy_a_batch_is_searched_query_by_query(bm25_index, monkeypatch):
    """scipy gives the batch its one sparse product; a machine without it (the bare GPU check machine a
    bundle runs on) gets the same scores query by query."""
    from spader_pipeline.retrieval import bm25

    retriever = BM25Retriever(bm25_index / "bm25")
    queries = [*EXPECTED, "the river and the country"]
    batched = retriever.search(queries, 5)
    monkeypatch.setattr(bm25, "_has_scipy", lambda: False)
    monkeypatch.setattr(retriever, "_term_matrix", None)  # the sparse path is not taken
    for (_, scores), (_, ref) in zip(retriever.search(queries, 5), batched, strict=True):
        np.testing.assert_array_equal(scores, ref)


def test_doc_store_get_many_equals_get(bm25_index):
    from spader_pipeline.retrieval.corpus import DocStore

    store = DocStore(bm25_index)
    rows = np.array([3, 0, 3, len(store) - 1])
    assert store.get_many(rows) == [store.get(int(r)) for r in rows]
    with pytest.raises(IndexError):
        store.get_many(np.array([len(store)]))


def test_bm25s_is_imported_with_jax_kept_on_the_cpu(monkeypatch):
    """Importing bm25s runs a JAX operation when JAX is installed, and JAX then takes 75% of a GPU's
    memory (seen on an H200: 106 GB per process). Unless the process chose JAX's platforms itself."""
    import os

    from spader_pipeline.retrieval.bm25s_import import import_bm25s

    monkeypatch.delitem(__import__("sys").modules, "jax", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert import_bm25s().BM25 is not None and os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    import_bm25s()
    assert os.environ["JAX_PLATFORMS"] == "cuda"
