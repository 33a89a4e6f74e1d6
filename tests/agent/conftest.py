"""Fixtures for agent tests: a small description-grouped corpus, its BM25 index, a real retrieval
server on 127.0.0.1, and a tiny randomly initialised Qwen3 with a tokenizer trained here."""

from __future__ import annotations

import json

import pytest
from agent_toy_data import GROUPS, QUESTIONS, corpus_records  # noqa: F401  (re-exported for fixtures)


@pytest.fixture(scope="session")
def toy_corpus_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent-corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in corpus_records()), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def toy_index(toy_corpus_path, tmp_path_factory):
    from spader_pipeline.retrieval import build_index_from_file

    out = tmp_path_factory.mktemp("agent-index") / "bm25"
    build_index_from_file(toy_corpus_path, out, "bm25")
    return out


@pytest.fixture(scope="session")
def retrieval_url(toy_index):
    """A real ``spader-retrieval serve`` process on 127.0.0.1 for the whole session."""
    from spader_pipeline.retrieval import running_service

    with running_service(toy_index) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_lm():
    """(model, tokenizer): a tiny random Qwen3ForCausalLM and a byte-level BPE trained on the toy corpus."""
    modeling = pytest.importorskip("spader_pipeline.modeling.base_model")
    from spader_pipeline.modeling.tokenizer import train_tokenizer

    texts = [r["contents"] for r in corpus_records()] + [q["question"] for q in QUESTIONS]
    texts += ['<think>x</think><tool_call>["query"]</tool_call><answer>["Entity"]</answer>'] * 5
    tokenizer = train_tokenizer(texts, vocab_size=600, min_frequency=1)
    spec = modeling.TinyQwen3Spec(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    model = modeling.build_tiny_qwen3(tokenizer, spec, seed=0)
    return model, tokenizer
