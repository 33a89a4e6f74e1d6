"""One record per sample for every stage: the question, then what the agent did."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from spader_pipeline.data.schema import sample_record


def test_question_record_normalises_what_storage_hands_back():
    row = {"id": 7, "question": "Which?", "ground_truth": np.array([np.array(["A", "a"]), "B"], dtype=object),
           "split": "test"}
    assert sample_record(row) == {"id": "7", "question": "Which?", "ground_truth": [["A", "a"], ["B"]],
                                  "data_source": None}


def test_outcome_follows_the_question_in_a_fixed_order():
    trajectory = SimpleNamespace(finish_reason="answer", messages=[{"role": "user", "content": "q"}], predicted=("A",))
    record = sample_record({"id": "x", "question": "q", "ground_truth": [["A"]], "data_source": "s"}, trajectory,
                           status="ok")
    assert list(record) == ["id", "question", "ground_truth", "data_source", "status", "finish_reason", "history",
                            "predicted"]
    assert record["predicted"] == ["A"] and record["history"][0]["role"] == "user"
