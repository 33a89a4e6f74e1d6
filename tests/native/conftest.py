"""Fixtures for the native-trainer tests: toy BM25 index, tiny Qwen3, config factory."""

from __future__ import annotations

import json

import pytest
from native_toy import TEMPLATE, corpus_records

from spader_pipeline.modeling import TinyQwen3Spec, build_base_model


@pytest.fixture(scope="session")
def toy_index_dir(tmp_path_factory):
    from spader_pipeline.retrieval import build_index_from_file

    root = tmp_path_factory.mktemp("native-index")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in corpus_records()))
    build_index_from_file(corpus, root / "bm25", "bm25")
    return root / "bm25"


@pytest.fixture(scope="session")
def native_model_dir(tmp_path_factory):
    texts = [f"{r['title']}\n{r['contents']}" for r in corpus_records()] * 3 + [TEMPLATE] * 5
    spec = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=2048)
    return build_base_model(texts, tmp_path_factory.mktemp("native-model"), spec=spec, vocab_size=400, min_frequency=1)


@pytest.fixture(scope="session")
def native_deep_model_dir(tmp_path_factory):
    """A 3-block model with grouped-query attention, for the boundary states (frozen blocks below)."""
    texts = [f"{r['title']}\n{r['contents']}" for r in corpus_records()] * 3 + [TEMPLATE] * 5
    spec = TinyQwen3Spec(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=2048)
    return build_base_model(texts, tmp_path_factory.mktemp("native-deep-model"), spec=spec, vocab_size=400,
                            min_frequency=1)


@pytest.fixture
def tiny_config():
    from spader_pipeline.native import NativeTrainerConfig

    def make(**overrides):
        base = dict(method="spader", total_steps=2, prompts_per_step=2, group_size=2, micro_batch_size=2,
                    rollout={"max_turns": 2, "max_response_tokens": 600}, max_new_tokens=10, checkpoint_every=1,
                    log_samples_every=1, num_samples_logged=1, reward={"cost_free_steps": 0}, options={"gamma": 0.9})
        base.update(overrides)
        return NativeTrainerConfig(**base)

    return make
