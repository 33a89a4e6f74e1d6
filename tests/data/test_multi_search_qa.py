"""The multi-search embedded task: unions of description groups, one search per group."""

import statistics

import pandas as pd
import pytest

from spader_pipeline.data import multi_search_qa, validation, wiki
from spader_pipeline.pipelines.data_prep import nodes


def _params(**overrides) -> dict:
    params = {
        "salt": "spader-v1",
        "splits": {"train": 0.6, "validation": 0.1, "test": 0.3},
        "min_answers": 5, "max_subgroups": 4, "max_subgroup_answers": 8, "min_subgroup_answers": 1,
        "max_share": 0.5, "max_uses_per_subgroup": 4, "max_facet_words": 4,
        "element_window": 10, "element_per_search": 3,
    }
    return {**params, **overrides}


def _synthetic_articles() -> pd.DataFrame:
    rows = []
    painters = {"French": 3, "Dutch": 2, "Italian": 2, "Spanish": 1, "German": 2}
    for nationality, n in painters.items():
        rows += [(f"{nationality} Painter {i}", f"{nationality} painter (1600–1650)") for i in range(n)]
    regions = {"West Africa": 3, "East Africa": 2, "North Africa": 2, "Southern Africa": 2}
    for region, n in regions.items():
        rows += [(f"{region} Country {i}", f"Country in {region}") for i in range(n)]
    rows += [(f"King {i}", f"King of Sweden from {1500 + 10 * i} to {1505 + 10 * i}") for i in range(3)]
    rows += [(f"Hungarian King {i}", "King of Hungary") for i in range(2)]
    rows += [(f"Polish King {i}", "King of Poland (1400–1410)") for i in range(2)]
    rows += [(f"Element {n}", f"Chemical element with atomic number {n} (X{n})") for n in range(1, 21)]
    rows += [("Big 0", "Family of birds")] * 1 + [(f"Big {i}", "Family of birds") for i in range(1, 12)]
    rows += [("Lonely", "Unique description of something")]
    return pd.DataFrame(
        [{"title": t, "description": d, "extract": f"{t} is a country, a king or a painter. " * 5, "topic": ""} for t, d in rows]
    ).drop_duplicates("title")


def test_description_normalisation_and_plurals():
    assert multi_search_qa.normalize_description("King of France from 987 to 996") == "King of France"
    assert multi_search_qa.normalize_description("French painter (1840–1926)") == "French painter"
    assert multi_search_qa.normalize_description("16th-century Italian painter") == "Italian painter"
    assert multi_search_qa.normalize_description("Empire in West Africa from c. 1230 to 1600") == "Empire in West Africa"
    assert multi_search_qa.normalize_description("Roman emperor from AD 14 to 37") == "Roman emperor"
    assert multi_search_qa.pluralize("actor and filmmaker") == "actors and filmmakers"
    assert multi_search_qa.pluralize("country") == "countries"
    assert multi_search_qa.pluralize("genus") == "genera"
    assert multi_search_qa.pluralize("class") == "classes"
    assert multi_search_qa.pluralize("statesman") == "statesmen"


def test_union_questions_on_synthetic_articles():
    articles = _synthetic_articles()
    questions = multi_search_qa.build_questions(articles, _params())
    by_text = {q.question: q for q in questions}
    assert "Which chemical elements have atomic numbers from 1 to 10?" in by_text
    elements = by_text["Which chemical elements have atomic numbers from 1 to 10?"]
    assert len(elements.titles) == 10 and len(elements.subgroups) == 4  # 3 + 3 + 3 + 1 numbers
    painters = [q for q in questions if q.question.endswith("painters are there?")]
    countries = [q for q in questions if q.question.startswith("Which countries are in ")]
    assert painters and countries
    assert any(q.question.startswith("Which kings of ") for q in questions)  # years dropped: one group
    for q in questions:
        sizes = [len(g.titles) for g in q.subgroups]
        assert 2 <= len(q.subgroups) <= 4 and len(q.titles) >= 5
        assert max(sizes) <= 0.5 * len(q.titles) and max(sizes) <= 8
        assert not any(t.startswith("Big") for t in q.titles)  # 12 birds: more than a few searches
    # deterministic, and the same rows through the node in multi_search mode
    assert multi_search_qa.build_questions(articles, _params()) == questions
    rows = nodes.build_embedded_questions(
        articles, {"enabled": True, "mode": "multi_search", "salt": "spader-v1", "multi_search": _params()}
    )
    assert list(rows["question"]) == [q.question for q in questions]
    assert rows["id"].is_unique


def test_membership_is_decidable_from_passages():
    """Every answer's passages start with a description that names one of the question's facets."""
    articles = _synthetic_articles()
    passages = {p["title"]: p["contents"] for p in wiki.iter_passages(articles)}
    for q in multi_search_qa.build_questions(articles, _params()):
        for group, query in zip(q.subgroups, q.queries, strict=True):
            assert query == group.description
            for title in group.titles:
                first_line = passages[title].split(". ", 1)[0]
                if not title.startswith("Element"):
                    assert multi_search_qa.normalize_description(first_line) == group.description
        if q.question.endswith("painters are there?"):
            for group in q.subgroups:
                assert group.description.split()[0] in q.question  # the nationality is named


def test_splits_share_no_answer_set_or_subgroup():
    articles = _synthetic_articles()
    params = _params(splits={"train": 0.5, "test": 0.5})
    for salt in ("a", "b", "c", "d"):
        questions = multi_search_qa.build_questions(articles, {**params, "salt": salt})
        split_of: dict[str, str] = {}
        for q in questions:
            for group in q.subgroups:
                assert split_of.setdefault(group.description, q.split) == q.split
        assert len({tuple(q.titles) for q in questions}) == len(questions)


@pytest.fixture(scope="module")
def real_questions():
    return multi_search_qa.build_questions(wiki.load_wiki_articles(), _params())


@pytest.mark.slow
def test_real_corpus_sizes(real_questions):
    """The thresholds of docs/data.md: >= 300 training and >= 150 held-out questions, median >= 5."""
    train = [q for q in real_questions if q.split == "train"]
    test = [q for q in real_questions if q.split == "test"]
    assert len(train) >= 300 and len(test) >= 150
    assert statistics.median(len(q.titles) for q in test) >= 5
    assert statistics.median(len(q.titles) for q in train) >= 5
    held_out = {tuple(q.titles) for q in real_questions if q.split != "train"}
    assert not held_out & {tuple(q.titles) for q in train}


@pytest.mark.slow
def test_real_rows_pass_validation(real_questions):
    rows = multi_search_qa.question_rows(real_questions)
    outcome = validation.validate_tables({"embedded": rows})
    assert len(outcome.clean) == len(rows) and len(outcome.quarantine) == 0


def test_question_wording():
    lower = {"romance": True, "dravidian": False, "country": False}  # heads are lowered regardless
    assert multi_search_qa.union_question("nationality", "painter", ["French", "Dutch", "German"], lower) == (
        "Which French, Dutch or German painters are there?"
    )
    assert multi_search_qa.union_question("in", "Country", ["West Africa", "East Africa"], lower) == (
        "Which countries are in West Africa or East Africa?"
    )
    assert multi_search_qa.union_question("in", "City", ["Maharashtra, India", "Egypt"], lower) == (
        "Which cities are in Maharashtra, India or Egypt?"
    )
    assert multi_search_qa.union_question("in", "City", ["Egypt", "Maharashtra, India", "Peru"], lower) == (
        "Which cities are in Egypt; Maharashtra, India or Peru?"
    )
    assert multi_search_qa.union_question("word", "language", ["Romance", "Dravidian"], lower) == (
        "Which romance or Dravidian languages are there?"
    )
    assert multi_search_qa.union_question("of", "Prime Minister", ["India", "Iran"], lower) == (
        "Which Prime Ministers of India or Iran are there?"
    )
    assert multi_search_qa.word_case(["The music was Catalan music. Music and Catalan art; music"]) == {
        "music": True, "catalan": False, "and": True, "art": True, "was": True,  # "The", "Music": sentence starts
    }
    lower["west"] = True
    assert multi_search_qa.union_question("word", "language", ["West Germanic", "Romance"], lower) == (
        "Which West Germanic or romance languages are there?"
    )
    assert multi_search_qa.union_question("of", "Greek goddess", ["love", "war"], lower) == (
        "Which Greek goddesses of love or war are there?"
    )
