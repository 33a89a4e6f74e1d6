"""Each native-format reader on a small fixture of that format (tests/data/fixtures)."""

from pathlib import Path

import pytest

from spader_pipeline.data import readers

FIXTURES = Path(__file__).parent / "fixtures"


def _by_id(rows):
    return {row["id"]: row for row in rows}


def test_qampari_reader_keeps_aliases_and_malformed_lines():
    rows = readers.read_qampari(FIXTURES / "qampari.jsonl", "qampari", "test")
    assert len(rows) == 6  # the non-JSON line becomes a row too (validation quarantines it)
    films = rows[0]
    assert films["id"] == "qampari:q-films"
    assert films["ground_truth"] == [
        ["Blazing Saddles", "Blazing Saddles (film)"],
        ["Young Frankenstein"],
        ["Spaceballs", "Space Balls"],
    ]
    assert films["split"] == "test" and films["data_source"] == "qampari"
    assert rows[3]["ground_truth"][1] == []  # entity whose only surface forms are empty
    # a truncated line: no reconstructed record, its raw text and the reason travel to validation
    assert rows[4] == {"id": "qampari:line5", "question": "", "ground_truth": [], "data_source": "qampari",
                       "split": "test", "parse_error": "invalid_json",
                       "raw_record": (FIXTURES / "qampari.jsonl").read_text().splitlines()[4]}


def test_mintaka_reader_entities_values_and_count_questions():
    rows = _by_id(readers.read_mintaka(FIXTURES / "mintaka.json", "mintaka", "dev"))
    assert rows["mintaka:a1"]["ground_truth"] == [["Ivory Coast"], ["Burkina Faso"], ["Togo"]]
    # count question: the supporting entities are the answer set
    assert rows["mintaka:a2"]["ground_truth"] == [
        ["Harry Potter and the Philosopher's Stone"],
        ["Harry Potter and the Chamber of Secrets"],
    ]
    assert rows["mintaka:a3"]["ground_truth"] == [["False"]]
    assert rows["mintaka:a4"]["ground_truth"] == []


def test_mintaka_reader_count_as_number():
    rows = _by_id(readers.read_mintaka(FIXTURES / "mintaka.json", "mintaka", "dev", count_as="number"))
    assert rows["mintaka:a2"]["ground_truth"] == [["7"]]


def test_webqsp_reader_unions_parses_and_never_uses_mids_as_names():
    rows = _by_id(readers.read_webqsp(FIXTURES / "webqsp.json", "webqsp", "test"))
    assert rows["webqsp:WebQTest-0"]["ground_truth"] == [["Jamaican English"], ["Jamaican Creole English Language"]]
    assert rows["webqsp:WebQTest-0"]["question"] == "what does jamaican people speak?"
    assert rows["webqsp:WebQTest-7"]["ground_truth"] == [["1889"]]  # value answer
    assert rows["webqsp:WebQTest-9"]["ground_truth"] == [[]]  # unnamed entity: quarantined later


def test_quest_reader_titles_with_bare_alias():
    rows = readers.read_quest(FIXTURES / "quest.jsonl", "quest", "test")
    assert rows[0]["ground_truth"] == [["Grey parrot"], ["Hooded vulture"]]
    assert rows[1]["ground_truth"] == [["Traffic (2000 film)", "Traffic"]]
    assert rows[0]["id"] != rows[1]["id"]


def test_unified_reader_accepts_reference_eval_format():
    rows = _by_id(readers.read_unified(FIXTURES / "unified.jsonl", "ignored", "test"))
    assert rows["unified_fixture:u2"]["question"] == "Which is the largest planet?"  # question_text
    assert rows["unified_fixture:u2"]["split"] == "validation"
    assert rows["unified_fixture:u1"]["split"] == "test"  # default split
    assert rows["unified_fixture:u3"]["ground_truth"] == "red, green, blue"  # left for validation


def test_read_dataset_skips_missing_optional_and_rejects_missing_required(tmp_path, caplog):
    spec = {"name": "qampari", "format": "qampari", "path": str(tmp_path / "absent.jsonl"), "optional": True}
    with caplog.at_level("INFO"):
        assert readers.read_dataset(spec) == []
    assert "not found, skipped" in caplog.text
    with pytest.raises(FileNotFoundError, match="required file"):
        readers.read_dataset({**spec, "optional": False})
    with pytest.raises(ValueError, match="unknown format"):
        readers.read_dataset({**spec, "format": "squad"})


def test_title_aliases():
    assert readers.title_aliases("Mercury (planet)") == ["Mercury (planet)", "Mercury"]
    assert readers.title_aliases("Ghana") == ["Ghana"]
