"""Shared retrieval fixtures: the fixture corpus and indexes built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from spader_pipeline.retrieval.index import build_index_from_file

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def corpus_path() -> Path:
    return FIXTURES / "corpus.jsonl"


@pytest.fixture(scope="session")
def bm25_index(tmp_path_factory, corpus_path) -> Path:
    out = tmp_path_factory.mktemp("bm25_index")
    build_index_from_file(corpus_path, out, "bm25", show_progress=False)
    return out


@pytest.fixture(scope="session")
def dense_index(tmp_path_factory, corpus_path) -> Path:
    out = tmp_path_factory.mktemp("dense_index")
    build_index_from_file(corpus_path, out, "dense", {"dense": {"index_type": "Flat"}}, show_progress=False)
    return out
