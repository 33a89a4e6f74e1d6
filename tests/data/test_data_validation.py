"""Validation and quarantine: every broken row is accounted for, with its reason."""

from pathlib import Path

import pytest

from spader_pipeline.data import readers
from spader_pipeline.data.validation import DataQualityError, enforce_quality_gate, validate_tables

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def outcome():
    tables = {
        "qampari": readers.read_qampari(FIXTURES / "qampari.jsonl", "qampari", "test"),
        "mintaka": readers.read_mintaka(FIXTURES / "mintaka.json", "mintaka", "test"),
        "webqsp": readers.read_webqsp(FIXTURES / "webqsp.json", "webqsp", "test"),
        "unified_fixture": readers.read_unified(FIXTURES / "unified.jsonl", "unified_fixture", "test"),
    }
    return tables, validate_tables(tables, max_question_chars=200)


def test_every_row_is_clean_or_quarantined(outcome):
    tables, result = outcome
    total_in = sum(len(rows) for rows in tables.values())
    assert len(result.clean) + len(result.quarantine) == total_in
    assert result.metrics["total"] == {
        "rows_in": total_in,
        "rows_clean": len(result.clean),
        "rows_quarantined": len(result.quarantine),
    }
    for name, rows in tables.items():
        table = result.metrics[name]
        assert table["rows_in"] == len(rows)
        assert table["rows_clean"] + table["rows_quarantined"] == len(rows)


def test_quarantine_reasons(outcome):
    _, result = outcome
    reasons = {(row.id, row.reasons) for row in result.quarantine.itertuples()}
    assert reasons == {
        ("qampari:q-empty-question", "empty_question"),
        ("qampari:q-no-answers", "no_answers"),
        ("qampari:q-empty-alias", "empty_alias"),
        ("qampari:line5", "invalid_json"),  # a truncated QAMPARI line
        ("qampari:q-films", "duplicate_id"),  # the second copy; the first is kept
        ("mintaka:a4", "no_answers"),
        ("webqsp:WebQTest-9", "empty_alias"),
        ("unified_fixture:u3", "bad_ground_truth;no_answers"),  # a string is no entity list
        ("unified_fixture:u4", "unknown_split"),
        ("unified_fixture:u5", "unmatchable_alias"),
    }
    assert result.metrics["qampari"]["quarantined"] == {
        "empty_question": 1, "no_answers": 1, "empty_alias": 1, "duplicate_id": 1, "invalid_json": 1
    }
    # the original record travels with the quarantined row
    films = result.quarantine[result.quarantine["id"] == "qampari:q-films"].iloc[0]
    assert "duplicate id" in films["record"]
    # an unreadable line is kept verbatim, not as a reconstructed empty record
    cut = result.quarantine[result.quarantine["id"] == "qampari:line5"].iloc[0]
    assert cut["record"] == (FIXTURES / "qampari.jsonl").read_text().splitlines()[4]
    assert cut["record"].startswith('{"qid": "q-cut"')


def test_clean_rows_keep_first_duplicate_and_schema(outcome):
    _, result = outcome
    assert list(result.clean.columns) == ["id", "question", "ground_truth", "data_source", "split"]
    films = result.clean[result.clean["id"] == "qampari:q-films"]
    assert len(films) == 1 and films.iloc[0]["question"] == "Which films did Mel Brooks direct?"
    assert result.clean["id"].is_unique


def test_question_length_limit():
    rows = [{"id": "x:1", "question": "q" * 50, "ground_truth": [["Ghana"]], "data_source": "x", "split": "test"}]
    assert validate_tables({"x": rows}, max_question_chars=10).quarantine["reasons"].tolist() == ["question_too_long"]


def test_quality_gate(outcome):
    _, result = outcome
    enforce_quality_gate(result.metrics, max_failure_rate=1.0)
    with pytest.raises(DataQualityError, match=r"qampari: 5/6 rows quarantined") as error:
        enforce_quality_gate(result.metrics, max_failure_rate=0.2)
    assert "qa_quarantine" in str(error.value)
