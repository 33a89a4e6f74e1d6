"""Metric definitions on hand-checked cases (aliases, duplicates, format errors, long-tail buckets)."""

from __future__ import annotations

import math

import pytest

from spader_pipeline.evaluation.metrics import (
    aggregate,
    bucket_labels,
    entity_corpus_frequency,
    sample_metrics,
)

GT = [["Entity A", "Alias A"], ["Entity B"], ["The Beatles", "Beatles"]]


def test_spec_worked_check_with_aliases_and_one_real_search():
    # SPADER's evaluation harness (docs/metrics.md): P 0.75, R 0.667, F1 0.706. Our search count is 1 (the prompt's example call is
    # not counted), so searches per correct entity is 1/2, not the reference's 3/2.
    m = sample_metrics(
        predicted=["Entity A", "Alias A", "Beatles", "Foo"],
        ground_truth=GT,
        assistant_turns=['<tool_call>["q"]</tool_call>', '<answer>["..."]</answer>'],
        num_searches=1,
        num_queries=1,
    )
    assert m["precision"] == pytest.approx(0.75)
    assert m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(0.7058823529)
    assert m["precision_entity"] == pytest.approx(2 / 3)  # two aliases of one entity count once
    assert m["exact_match"] == 0.0 and m["format_error"] == 0.0
    assert m["num_answers"] == 4 and m["num_predicted"] == 4 and m["num_matched"] == 2
    assert m["searches_per_correct"] == pytest.approx(0.5)
    assert m["num_turns"] == 2
    assert m["matched_entities"] == [True, False, True]


def test_duplicates_and_normalisation_collapse():
    m = sample_metrics(predicted=["the beatles", "Beatles", "BEATLES!", "Entity B"], ground_truth=GT)
    assert m["num_answers"] == 4 and m["num_predicted"] == 2  # "beatles" once, "entity b" once
    assert m["precision"] == 1.0 and m["recall"] == pytest.approx(2 / 3)


def test_exact_set_match_and_recall_at_k():
    m = sample_metrics(predicted=["Alias A", "Entity B", "Beatles"], ground_truth=GT)
    assert m["exact_match"] == 1.0 and m["f1"] == 1.0
    big = [[f"e{i}"] for i in range(30)]
    m = sample_metrics(predicted=[f"e{i}" for i in range(6)], ground_truth=big)
    assert m["recall_at_5"] == 1.0  # 6 found ≥ min(5, 30)
    assert m["recall_at_10"] == pytest.approx(0.6)
    assert m["recall_at_50"] == pytest.approx(6 / 30)


def test_format_error_scores_zero_but_keeps_counts():
    m = sample_metrics(
        predicted=None, ground_truth=GT, assistant_turns=["x", "y"], num_searches=1, num_invalid_turns=2
    )
    assert m["format_error"] == 1.0 and m["f1"] == 0.0 and m["num_answers"] == 0
    assert m["num_searches"] == 1 and m["num_invalid_turns"] == 2
    assert math.isnan(m["searches_per_correct"])
    empty = sample_metrics(predicted=[], ground_truth=GT)
    assert empty["format_error"] == 0.0 and empty["precision"] == 0.0


def test_seen_versus_answered_uses_retrieved_text_with_word_boundaries():
    texts = ["Title: Beatles\nthe beatles were a band", "entity beatles is not entity b"]
    m = sample_metrics(
        predicted=["Beatles"], ground_truth=[["Entity B"], ["The Beatles", "Beatles"]], retrieved_texts=texts
    )
    assert m["num_seen"] == 2  # "entity b" occurs as whole words in the second text
    assert m["num_seen_and_matched"] == 1 and m["answered_given_seen"] == pytest.approx(0.5)
    m = sample_metrics(predicted=[], ground_truth=[["Entity B"]], retrieved_texts=["entity beatles"])
    assert m["num_seen"] == 0 and math.isnan(m["answered_given_seen"])


def test_corpus_frequency_and_long_tail_buckets():
    corpus = ["Ghana and Togo", "Ghana again", "Togo", "Ghana", "nothing here"]
    freqs = entity_corpus_frequency(
        [[["Ghana"], ["Mali"]], [["Togo", "Togolese Republic"], ["Ghana"]]], corpus, chunk_size=2
    )
    assert freqs == [[3, 0], [2, 3]]
    assert bucket_labels((1, 2, 5, 20)) == ["0", "1", "2-4", "5-19", "20_or_more"]
    records = [
        sample_metrics(
            predicted=["Ghana"], ground_truth=[["Ghana"], ["Mali"]], corpus_frequency=freqs[0], num_searches=2
        ),
        sample_metrics(
            predicted=["Togo"], ground_truth=[["Togo"], ["Ghana"]], corpus_frequency=freqs[1], num_searches=1
        ),
    ]
    agg = aggregate(records, num_failed=1, long_tail_edges=(1, 2, 5, 20))
    assert agg["long_tail_recall/0"] == 0.0 and agg["long_tail_entities/0"] == 1
    assert agg["long_tail_recall/2-4"] == pytest.approx(2 / 3) and agg["long_tail_entities/2-4"] == 3
    assert math.isnan(agg["long_tail_recall/20_or_more"])
    assert agg["num_samples"] == 2 and agg["num_failed"] == 1 and agg["failure_rate"] == pytest.approx(1 / 3)
    assert agg["recall"] == pytest.approx(0.5) and agg["num_searches"] == pytest.approx(1.5)
    assert agg["searches_per_correct_entity"] == pytest.approx(3 / 2)  # ratio of sums
