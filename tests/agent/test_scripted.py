"""The scripted policy on questions with several facets (the multi-search task, docs/data.md): the
facet parser on every question form the builder writes, the policy through the real rollout loop
over a real BM25 index, seeded wordings, and the single-facet behaviour left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from agent_toy_data import QUESTIONS

from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.protocol import parse_turn
from spader_pipeline.agent.question_facets import _signature, parse_facets, singular
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.scripted import (
    _AGAIN,
    _FACET_ANSWER,
    _FIRST_FACET,
    _NEXT_FACET,
    ScriptedPolicy,
    evidence_line,
)
from spader_pipeline.agent.types import RolloutConfig, Step
from spader_pipeline.data import embedded_qa, multi_search_qa, wiki
from spader_pipeline.retrieval import build_index_from_file
from spader_pipeline.retrieval.index import load_retriever
from spader_pipeline.retrieval.service import LocalSearch

THOUGHTS = {_FIRST_FACET, _NEXT_FACET, _AGAIN, _FACET_ANSWER, "No passage matches."}
ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = resolve_template(yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"])

#: description → number of articles; every form the builder writes (nationality, "<facet> <word>",
#: "<head> in/of <facet>", a place with a comma, a head of several words, atomic numbers)
GROUPS = {
    "French composer": 2, "Czech composer": 2, "Russian composer (1840–1893)": 2, "Austrian composer": 4,
    "Dutch mathematician and physicist": 2, "Swiss mathematician and physicist": 3,
    "Cushitic language": 2, "Semitic language": 3, "West Germanic language": 2,
    "Bangladesh–Pakistan armed conflict": 2, "Global conflict": 3, "Intense armed conflict": 2,
    "Country in West Africa": 3, "Country in East Asia": 2, "Country in the Lesser Antilles": 2,
    "City in Maharashtra, India": 2, "City in Egypt": 2, "City in Peru": 3,
    "King of Sweden from 1500 to 1510": 3, "King of Hungary": 2, "King of the Hittites": 2,
    "Prime Minister of India": 2, "Prime Minister of Iran": 3,
    "Family of fruit bats": 2, "Family of primates": 3,
}
NAMES = "Alder Birch Cedar Dogwood Elm Fir Gum Hazel Ivy Juniper Kapok Larch Maple".split()


def _articles() -> pd.DataFrame:
    rows, k = [], 0
    for description, n in GROUPS.items():
        for _ in range(n):
            title = f"{NAMES[k % len(NAMES)]} {k}"
            rows.append((title, description, f"{title} is remembered for item {k}, a global and intense matter."))
            k += 1
    for number in range(1, 11):
        rows.append((f"Element {number}", f"Chemical element with atomic number {number} (X{number})", f"Element {number} is a substance."))
    return pd.DataFrame([{"title": t, "description": d, "extract": e, "topic": ""} for t, d, e in rows])


PARAMS = {
    "salt": "scripted", "splits": {"train": 1.0}, "min_answers": 4, "max_subgroups": 4,
    "max_subgroup_answers": 8, "min_subgroup_answers": 1, "max_share": 0.75, "max_uses_per_subgroup": 4,
    "max_facet_words": 4, "element_window": 10, "element_per_search": 3,
}


@pytest.fixture(scope="module")
def questions():
    return multi_search_qa.build_questions(_articles(), PARAMS)


@pytest.fixture(scope="module")
def facet_search(tmp_path_factory):
    """A real BM25 index over the passages of the synthetic articles, searched in process."""
    folder = tmp_path_factory.mktemp("facets")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in wiki.iter_passages(_articles())), encoding="utf-8")
    build_index_from_file(corpus, folder / "bm25", "bm25")
    return LocalSearch(load_retriever(folder / "bm25"))


def test_every_builder_form_is_parsed_into_its_descriptions(questions):
    forms = set()
    for q in questions:
        facets = parse_facets(q.question)
        assert facets is not None, q.question
        forms.add(facets.form)
        if facets.form == "elements":
            assert [f"Chemical element with atomic number {f}" for f in facets.facets] == list(q.queries)
            continue
        readings = [sorted(sorted(_signature(facets.description(i))) for i in range(len(facets.facets)))]
        if facets.joined:  # "Maharashtra, India or Peru": two facets or three
            first = _signature(facets.description(0)) | _signature(facets.facets[1])
            readings.append(sorted([sorted(first), sorted(_signature(facets.description(2)))]))
        assert sorted(sorted(_signature(d)) for d in q.queries) in readings, q.question
    assert forms == {"leading", "in", "of", "elements"}
    asked = " ".join(q.question for q in questions)
    for phrase in ("composers are there", "mathematicians and physicists", "languages are there",
                   "conflicts are there", "countries are in", "Egypt; Maharashtra, India or", "kings of",
                   "Prime Ministers of", "families of", "atomic numbers from 1 to 10"):
        assert phrase in asked, phrase  # the synthetic frame covers that form


def test_evidence_lines_match_their_facet(questions):
    passages = {p["title"]: p["contents"] for p in wiki.iter_passages(_articles())}
    for q in questions:
        facets = parse_facets(q.question)
        for group in q.subgroups:
            indices = {facets.match(evidence_line(passages[title])) for title in group.titles}
            assert len(indices) == 1 and None not in indices, (q.question, group.description)
    facets = parse_facets("Which Czech or Russian composers are there?")
    assert facets.match("Russian composer (1840–1893)") == 1
    assert facets.match("Russian composers") == 1  # plurals fold
    assert facets.match("Russian pianist") is None and facets.match("Russian-born composer") is None
    assert facets.match("Soviet Russian composer") is None  # the description, not a line containing it


def test_parser_details():
    facets = parse_facets("Which Dutch, French, Greek or Swiss mathematicians and physicists are there?")
    assert (facets.form, facets.head, facets.facets) == (
        "leading", "mathematician and physicist", ("Dutch", "French", "Greek", "Swiss"))
    facets = parse_facets("Which Bangladesh–Pakistan armed, global or military conflicts are there?")
    assert facets.head == "conflict" and facets.facets == ("Bangladesh–Pakistan armed", "global", "military")
    facets = parse_facets("Which cities are in East Azerbaijan, Iran; Turkey or the West Midlands, England?")
    assert facets.facets == ("East Azerbaijan, Iran", "Turkey", "the West Midlands, England")
    assert facets.queries(1)[0] == "city in Turkey"
    facets = parse_facets("Which cities are in Maharashtra, India or Peru?")
    assert facets.joined and facets.facets == ("Maharashtra", "India", "Peru")
    assert [facets.match(f"City in {place}") for place in ("Maharashtra, India", "India", "Peru", "Chile")] == [0, 1, 2, None]
    assert not parse_facets("Which cities are in Egypt; Maharashtra, India or Peru?").joined
    facets = parse_facets("Which Greek goddesses of love or war are there?")
    assert (facets.form, facets.head, facets.facets) == ("of", "Greek goddess", ("love", "war"))
    facets = parse_facets("Which chemical elements have atomic numbers from 21 to 30?")
    assert facets.numbers == ((21, 22, 23), (24, 25, 26), (27, 28, 29), (30,))
    assert facets.match("Chemical element with atomic number 27 (Co)") == 2
    assert facets.match("Chemical element with atomic number 31 (Ga)") is None
    assert [singular(w) for w in ("countries", "genera", "classes", "statesmen", "species", "churches")] == [
        "country", "genus", "class", "statesman", "species", "church"]


def test_questions_of_the_default_task_have_one_facet():
    for description in ("Country in West Africa", "Play by William Shakespeare", "Cushitic language",
                        "Family of birds", "Film or television series", "City in Maharashtra, India",
                        "Chemical element with atomic number 27", "Genus of plants"):
        for question in (embedded_qa.multi_answer_question(description), embedded_qa.single_answer_question(description)):
            assert parse_facets(question) is None, question
    for sample in QUESTIONS:
        assert parse_facets(sample["question"]) is None
    # a description that is itself a list reads as facets; its own lines still match
    facets = parse_facets(embedded_qa.multi_answer_question("Genus of plants, fungi or algae"))
    assert facets.facets == ("plants", "fungi", "algae") and facets.match("Genus of plants, fungi or algae") == 0


@pytest.mark.slow
def test_no_question_of_the_descriptions_task_has_several_facets():
    """The one-search task (``embedded_qa.mode: descriptions``) over the real corpus: every question
    takes the single-facet path."""
    conf = yaml.safe_load((ROOT / "conf/base/parameters_data_prep.yml").read_text())["data_prep"]["embedded_qa"]
    rows = embedded_qa.build_embedded_qa(wiki.load_wiki_articles(), {**conf, "mode": "descriptions"})
    assert len(rows) > 200 and not [r["question"] for r in rows if parse_facets(r["question"]) is not None]


#: the turns of the policy before questions with several facets existed (topk 3, toy corpus)
_SEARCH_KEY_WORDS = "<think>Search the question's key words.</think>\n<tool_call>[\"{}\"]</tool_call>"
_SEARCH_LINE = "<think>Search the first line the matching passages share.</think>\n<tool_call>[\"{}\"]</tool_call>"
_ANSWER = "<think>The titles of the matching passages.</think>\n<answer>{}</answer>"
SINGLE_FACET_TURNS = {
    "q-west": [_SEARCH_KEY_WORDS.format("countries West Africa"), _SEARCH_LINE.format("Country in West Africa"),
               _ANSWER.format('["Senegal", "Mali", "Togo"]')],
    "q-play": [_SEARCH_KEY_WORDS.format("plays written William Shakespeare"),
               _SEARCH_LINE.format("Play by William Shakespeare"), _ANSWER.format('["Macbeth", "Othello", "Hamlet"]')],
    "q-birds": [_SEARCH_KEY_WORDS.format("Family of birds"), _ANSWER.format('["Strigidae", "Corvidae"]')],
}


@pytest.mark.parametrize("options", [{}, {"follow_up": False}, {"query_style": "varied", "seed": 3}])
def test_single_facet_turns_are_unchanged(toy_index, options):
    search = LocalSearch(load_retriever(toy_index))
    trajectories = run_rollouts_sync(QUESTIONS, ScriptedPolicy(**options), search, RolloutConfig(topk=3), TEMPLATE)
    for t in trajectories:
        expected = SINGLE_FACET_TURNS[t.id]
        if options.get("follow_up") is False:
            expected = [expected[0], expected[-1]]
        assert [s.text for s in t.steps] == expected


def _recall(trajectories, questions):
    for t, q in zip(trajectories, questions, strict=True):
        predicted = set(t.predicted or ())
        assert predicted <= set(q.titles), t.question  # every answer is right
        yield len(predicted) / len(q.titles)


@pytest.mark.parametrize("style", ["fixed", "varied"])
def test_policy_searches_each_facet_through_the_rollout_loop(questions, facet_search, style):
    samples = multi_search_qa.question_rows(questions)
    policy = ScriptedPolicy(query_style=style, seed=1, max_searches=None)
    trajectories = run_rollouts_sync(samples, policy, facet_search, RolloutConfig(topk=3, max_turns=12), TEMPLATE)
    follow_ups = 0
    for t, q in zip(trajectories, questions, strict=True):
        facets = parse_facets(q.question)
        assert t.finish_reason == "answer" and t.num_invalid_turns == 0
        searches = [s for s in t.steps if s.kind == "search"]
        assert all(len(s.queries) == 1 for s in searches)  # one search per step
        assert len(facets.facets) <= len(searches) <= 2 * len(facets.facets)
        planned = {facets.queries(i)[w] for i, w, _ in policy.plan(facets, {"id": t.id, "question": t.question})}
        assert {s.queries[0] for s in searches[: len(facets.facets)]} == planned
        for step in searches[len(facets.facets) :]:  # a follow-up re-asks a facet whose hits all matched
            follow_ups += 1
            assert step.text.startswith("<think>All matched")
            assert step.queries[0] not in planned
        for step in t.steps:
            assert parse_turn(step.text).kind == step.kind and step.text.startswith("<think>")
            assert step.text.split("</think>")[0].removeprefix("<think>") in THOUGHTS  # never a passage
    assert follow_ups > 0  # the four Austrian composers (topk 3)
    assert sum(_recall(trajectories, questions)) / len(questions) > 0.95


def test_max_searches_and_no_follow_up(questions, facet_search):
    samples = multi_search_qa.question_rows(questions)
    config = RolloutConfig(topk=3, max_turns=12)
    for options, most in (({"max_searches": 1}, 1), ({"max_searches": 2}, 2), ({"follow_up": False, "max_searches": None}, 4)):
        trajectories = run_rollouts_sync(samples, ScriptedPolicy(**options), facet_search, config, TEMPLATE)
        assert all(t.finish_reason == "answer" and 1 <= t.num_searches <= most for t in trajectories)
        list(_recall(trajectories, questions))  # answers stay right with fewer searches
    with pytest.raises(ValueError, match="query_style"):
        ScriptedPolicy(query_style="random")


def test_varied_wordings_are_deterministic_per_seed_and_question(questions):
    def plans(seed):
        policy = ScriptedPolicy(query_style="varied", seed=seed)
        return [policy.plan(parse_facets(q.question), {"id": f"id-{k}", "question": q.question}) for k, q in enumerate(questions)]

    assert plans(0) == plans(0) and plans(0) != plans(1)
    wordings = {w for plan in plans(0) for _, w, _ in plan}
    assert len(wordings) > 2  # several wordings, not one template
    for plan, q in zip(plans(0), questions, strict=True):
        n = len(parse_facets(q.question).facets)
        assert sorted(i for i, _, _ in plan) == list(range(n))
        assert all(first != again for _, first, again in plan)
    assert any([i for i, _, _ in plan] != sorted(i for i, _, _ in plan) for plan in plans(0))  # orders vary
    fixed = ScriptedPolicy()
    for q in questions:
        n = len(parse_facets(q.question).facets)
        assert fixed.plan(parse_facets(q.question), {"question": q.question}) == [(i, 0, 1) for i in range(n)]
    # the id keys the draw (the question when there is none)
    facets = parse_facets(questions[0].question)
    policy = ScriptedPolicy(query_style="varied", seed=0)
    assert policy.plan(facets, {"question": "x"}) == policy.plan(facets, {"id": "", "question": "x"})


def test_follow_up_waits_for_every_facet_and_answers_the_union():
    facets = parse_facets("Which Czech or French composers are there?")
    policy = ScriptedPolicy()
    plan = policy.plan(facets, {"question": ""})

    def step(query, lines):
        return Step(turn=1, text="", kind="search", queries=(query,), titles=[[t for t, _ in lines]],
                    retrieved_texts=[f"{t}\n{line}. Text." for t, line in lines])

    czech = step("Czech composer", [("A", "Czech composer"), ("B", "Czech composer (1841–1904)"), ("C", "Czech composers")])
    french = step("French composer", [("D", "French composer"), ("E", "French painter"), ("F", "Czech composer")])
    assert parse_turn(policy.facet_turn(facets, plan, [])).queries == ("Czech composer",)
    assert parse_turn(policy.facet_turn(facets, plan, [czech])).queries == ("French composer",)
    again = parse_turn(policy.facet_turn(facets, plan, [czech, french]))
    assert again.queries == ("Czech composers",)  # only Czech's hits all matched
    more = step("Czech composers", [("G", "Czech composer"), ("A", "Czech composer")])
    answer = parse_turn(policy.facet_turn(facets, plan, [czech, french, more]))
    assert answer.kind == "answer" and answer.answers == ("A", "B", "C", "D", "F", "G")
    assert parse_turn(ScriptedPolicy(follow_up=False).facet_turn(facets, plan, [czech, french])).kind == "answer"
