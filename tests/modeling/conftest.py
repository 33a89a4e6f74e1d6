"""A tiny corpus and a tiny model built from it, shared by the modeling tests."""

from __future__ import annotations

import pandas as pd
import pytest

from spader_pipeline.modeling import TinyQwen3Spec, build_base_model

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
