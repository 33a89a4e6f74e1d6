"""Evaluation batches sized by a KV-cache memory budget: fewer rows per batch, the same records."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoConfig

from spader_pipeline.evaluation.config import EvaluationConfig
from spader_pipeline.evaluation.suite import evaluate_models, select_models
from spader_pipeline.modeling.memory_budget import GROWTH, kv_bytes_per_token, rows_within_budget


def test_rows_follow_the_cache_size_of_the_model(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    per_token = kv_bytes_per_token(config)
    assert per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    one_row_mb = per_token * 1000 * GROWTH / 2**20
    assert rows_within_budget(config, 1000, 3.5 * one_row_mb, limit=100) == 3
    assert rows_within_budget(config, 1000, 1000 * one_row_mb, limit=100) == 100
    assert rows_within_budget(config, 1000, one_row_mb / 10, limit=100) == 1  # never zero rows
    with pytest.raises(ValueError, match="kv_cache_budget_mb"):
        rows_within_budget(config, 1000, 0, limit=4)


@pytest.mark.slow
def test_a_budgeted_evaluation_gives_the_same_records_in_smaller_batches(tiny_model_dir, tmp_path, caplog):
    from spader_pipeline.retrieval.index import build_index_from_file

    docs = [("Ghana", "Country in West Africa."), ("Togo", "Country in West Africa."),
            ("Hamlet", "Play by William Shakespeare."), ("Macbeth", "Play by William Shakespeare.")]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": t, "contents": c}) + "\n"
                              for i, (t, c) in enumerate(docs)))
    build_index_from_file(corpus, tmp_path / "index", "bm25", show_progress=False)
    questions = [{"id": f"q{i}", "question": q, "ground_truth": [[t] for t in gt]} for i, (q, gt) in enumerate([
        ("Which countries are in West Africa?", ["Ghana", "Togo"]),
        ("Which plays were written by William Shakespeare?", ["Hamlet", "Macbeth"]),
        ("Which country is Ghana's neighbour?", ["Togo"]),
        ("Name a tragedy by Shakespeare.", ["Macbeth"]),
        ("Which West African country has Accra?", ["Ghana"]),
    ])]
    entry = {"kind": "hf", "path": str(tiny_model_dir), "batch_size": 5,
             "sampling": {"temperature": 0.0, "max_new_tokens": 12}, "rollout": {"max_turns": 2}}
    tokens = 1024 + 4096  # the generator's max_prompt_tokens + evaluate.rollout.max_response_tokens
    per_row_mb = kv_bytes_per_token(AutoConfig.from_pretrained(tiny_model_dir)) * tokens * GROWTH / 2**20
    config = EvaluationConfig.from_mapping({
        "models": [{"name": "whole", **entry}, {"name": "budget", **entry, "kv_cache_budget_mb": 2.5 * per_row_mb}],
        "runner": {"work_dir": str(tmp_path / "work"), "progress": False},
    })
    prompt = {"template": "t", "templates": {"t": "Question: {question}"}}
    with caplog.at_level(logging.INFO, logger="spader_pipeline.evaluation.suite"):
        whole, budget = evaluate_models(config, select_models(config), {"toy": questions}, {},
                                        index_manifest={"index_dir": str(tmp_path / "index")}, prompt=prompt)
    assert "budget: batches of 2 rows (of 5)" in caplog.text
    # as JSON: the records hold NaN (no correct answer), which == tells apart once pickled from a child
    assert json.dumps(budget.records) == json.dumps(whole.records) and len(whole.records) == 5
    assert all(r["status"] == "ok" and r["steps"] for r in whole.records)
