"""A tiny corpus and a tiny model built from it, shared by the modeling tests."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from spader_pipeline.modeling import TinyQwen3Spec, build_base_model, build_tiny_qwen3
from spader_pipeline.modeling.attention import use_gqa_attention

TINY_SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                          intermediate_size=128, max_position_embeddings=1024)


def tiny_corpus(n: int = 60) -> pd.DataFrame:
    countries = ["Ghana", "Togo", "Benin", "Mali", "Niger", "Senegal"]
    rows = []
    for i in range(n):
        name = countries[i % len(countries)] + ("" if i < len(countries) else f" {i}")
        rows.append({"id": str(i), "title": name,
                     "contents": f"Country in West Africa. {name} is a country with a capital and rivers number {i}."})
    return pd.DataFrame(rows)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_base")
    texts = (f"{r.title}\n{r.contents}" for r in tiny_corpus().itertuples())
    return build_base_model(texts, out, spec=TINY_SPEC, vocab_size=400, min_frequency=1)


class _SixtyFourTokens:
    """The two attributes and the length ``build_tiny_qwen3`` reads from a tokenizer."""

    eos_token_id, pad_token_id = 2, 0

    def __len__(self) -> int:
        return 64


@pytest.fixture(scope="session")
def gqa_model_dir(tmp_path_factory):
    """A 2-layer Qwen3 with grouped-query attention (4 query heads, 2 key-value heads), 64 tokens."""
    out = tmp_path_factory.mktemp("tiny_gqa")
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=256)
    build_tiny_qwen3(_SixtyFourTokens(), spec).save_pretrained(out)
    return out


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    """A 3-layer Llama (SmolLM2's family) with grouped-query attention (6 query heads, 2 key-value heads),
    tied embeddings, 64 tokens, randomly initialised from seed 0: a fresh model for each test."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config)


@pytest.fixture(params=["qwen3", "llama"])
def tiny_model(request, gqa_model_dir):
    """The tests' tiny Qwen3 and a tiny Llama, on the sdpa_gqa attention, without gradients."""
    model = (AutoModelForCausalLM.from_pretrained(gqa_model_dir) if request.param == "qwen3"
             else request.getfixturevalue("tiny_llama"))
    model.eval().requires_grad_(False)
    assert use_gqa_attention(model)
    return model
