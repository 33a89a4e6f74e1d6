"""Protocol parsing tables, observation format, and fuzzing that no input makes the parser raise."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spader_pipeline.agent.protocol import (
    FORMAT_HINT,
    ParsedTurn,
    count_queries,
    count_search_calls,
    extract_last_answer,
    format_error_observation,
    format_observation,
    parse_turn,
)

SEARCH, ANSWER, INVALID = "search", "answer", "invalid"

PARSE_TABLE = [
    # (id, text, kind, queries, answers)
    ("plain list", '<think>x</think><tool_call>["a", "b"]</tool_call>', SEARCH, ("a", "b"), ()),
    ("whitespace/newlines", '<tool_call>\n [ " a ",\n"b" ]\n</tool_call>', SEARCH, ("a", "b"), ()),
    ("nested lists flattened", '<tool_call>[["a", ["b"]], "c"]</tool_call>', SEARCH, ("a", "b", "c"), ()),
    ("empty items dropped", '<tool_call>["", "  ", "a", null]</tool_call>', SEARCH, ("a",), ()),
    ("numbers kept as text", '<tool_call>["year", 1984]</tool_call>', SEARCH, ("year", "1984"), ()),
    ("bare string", '<tool_call>"solo query"</tool_call>', SEARCH, ("solo query",), ()),
    (
        "legacy dict",
        '<tool_call>{"name": "search", "arguments": {"query_list": ["q"]}}</tool_call>',
        SEARCH,
        ("q",),
        (),
    ),
    (
        "legacy dict, string args",
        '<tool_call>{"name": "search", "arguments": "{\\"query_list\\": [\\"q\\"]}"}</tool_call>',
        SEARCH,
        ("q",),
        (),
    ),
    ("legacy dict, no name", '<tool_call>{"query_list": ["q1", "q2"]}</tool_call>', SEARCH, ("q1", "q2"), ()),
    ("python literal list", "<tool_call>['a', 'b']</tool_call>", SEARCH, ("a", "b"), ()),
    (
        "last block wins (echo in think)",
        '<think>e.g. <tool_call>["query1", "query2"]</tool_call></think><tool_call>["real"]</tool_call>',
        SEARCH,
        ("real",),
        (),
    ),
    (
        "answer after echoed call",
        '<think><tool_call>["x"]</tool_call></think><answer>["A"]</answer>',
        ANSWER,
        (),
        ("A",),
    ),
    ("answer list", '<answer>["Ghana", "Togo"]</answer>', ANSWER, (), ("Ghana", "Togo")),
    ("empty answer is valid", "<answer>[]</answer>", ANSWER, (), ()),
    ("answer bare string", '<answer>"Ghana"</answer>', ANSWER, (), ("Ghana",)),
    ("unicode answer", '<answer>["Zürich", "東京"]</answer>', ANSWER, (), ("Zürich", "東京")),
    ("answer free text", "<answer>Ghana and Togo</answer>", INVALID, (), ()),
    ("no action", "I think the answer is Ghana.", INVALID, (), ()),
    ("empty text", "", INVALID, (), ()),
    ("truncated tool call", '<think>ok</think><tool_call>["a", "b', INVALID, (), ()),
    ("truncated answer", '<answer>["a"', INVALID, (), ()),
    ("broken json", '<tool_call>["a" "b"]</tool_call>', INVALID, (), ()),
    ("empty call", "<tool_call></tool_call>", INVALID, (), ()),
    ("empty query list", "<tool_call>[]</tool_call>", INVALID, (), ()),
    ("number payload", "<tool_call>42</tool_call>", INVALID, (), ()),
    (
        "unknown tool",
        '<tool_call>{"name": "rm", "arguments": {"query_list": ["q"]}}</tool_call>',
        INVALID,
        (),
        (),
    ),
    (
        "dict without query_list",
        '<tool_call>{"name": "search", "arguments": {"foo": 1}}</tool_call>',
        INVALID,
        (),
        (),
    ),
    ("deep nesting", "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", INVALID, (), ()),
    ("mismatched tags", '<tool_call>["a"]</answer>', INVALID, (), ()),
]


@pytest.mark.parametrize(
    ("text", "kind", "queries", "answers"),
    [row[1:] for row in PARSE_TABLE],
    ids=[row[0] for row in PARSE_TABLE],
)
def test_parse_turn_table(text, kind, queries, answers):
    parsed = parse_turn(text)
    assert parsed.kind == kind, parsed
    assert parsed.queries == queries
    assert parsed.answers == answers
    assert (parsed.error is None) == (kind != INVALID)
    if kind == INVALID:
        assert parsed.error and isinstance(parsed.error, str)


@pytest.mark.parametrize("value", [None, 3, b"<answer>[]</answer>", ["<answer>[]</answer>"]])
def test_parse_turn_non_text_is_invalid(value):
    assert parse_turn(value).kind == INVALID


def test_count_queries_counts_only_the_executed_call():
    text = '<think>like <tool_call>["query1", "query2"]</tool_call></think><tool_call>["a", "b", "c"]</tool_call>'
    assert count_queries(text) == 3
    assert count_queries('<answer>["x"]</answer>') == 0
    assert count_queries("<tool_call>oops</tool_call>") == 0


def test_count_search_calls_ignores_invalid_and_answer_turns():
    turns = [
        '<tool_call>["a"]</tool_call>',
        "garbage",
        '<tool_call>["b", "c"]</tool_call>',
        '<answer>["x"]</answer>',
    ]
    assert count_search_calls(turns) == 2


def test_extract_last_answer():
    assert extract_last_answer('<answer>["a"]</answer> then <answer>["b", "c"]</answer>') == ("b", "c")
    assert extract_last_answer('<answer>["a"]</answer><answer>not json</answer>') == ("a",)
    assert extract_last_answer("no answer here") is None
    assert extract_last_answer("<answer>[]</answer>") == ()
    assert extract_last_answer(['<answer>["a"]</answer>', '<tool_call>["q"]</tool_call>']) == ("a",)
    assert extract_last_answer([None, 5]) is None


def _doc(title, contents):
    return SimpleNamespace(id=title.lower(), title=title, contents=contents, score=1.0)


def test_format_observation_layout_without_query_echo():
    results = [
        SimpleNamespace(
            query="west african country",
            documents=[
                _doc("Ghana", "Country in West Africa.\nGhana is ..."),
                _doc("Togo", "Country in West Africa."),
            ],
        ),
        {"query": "nothing", "documents": []},
    ]
    text = format_observation(results, "System Note: Retrieval results truncated at 10000 characters.")
    assert text == (
        "<tool_response>\n"
        "Results for query 1:\n"
        "Doc 1 (Title: Ghana) Country in West Africa. Ghana is ...\n"
        "Doc 2 (Title: Togo) Country in West Africa.\n"
        "Results for query 2:\n"
        "(no results)\n"
        "System note: Retrieval results truncated at 10000 characters.\n"
        "</tool_response>"
    )
    assert "west african country" not in text  # the model's query is never echoed


def test_format_observation_caps_length_and_keeps_tags():
    results = [{"documents": [{"title": f"T{i}", "contents": "word " * 100} for i in range(20)]}]
    text = format_observation(results, max_chars=1000)
    assert text.startswith("<tool_response>\n") and text.endswith("\n</tool_response>")
    assert len(text) < 1200
    assert "Results truncated at 1000 characters." in text


def test_format_error_observation():
    text = format_error_observation(parse_turn("hello").error)
    assert text.startswith("<tool_response>\nError: the turn contains neither")
    assert FORMAT_HINT in text and text.endswith("</tool_response>")


# ---- fuzzing: nothing raises, the result is always well formed -------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
_fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<answer>",
        "</answer>",
        "<think>",
        "</think>",
        "[",
        "]",
        "{",
        "}",
        '"',
        ",",
        "\\",
        "\n",
        "null",
        "query_list",
        "name",
    ]
)


def _check(parsed: ParsedTurn) -> None:
    assert parsed.kind in (SEARCH, ANSWER, INVALID)
    assert all(isinstance(q, str) and q and q == q.strip() for q in parsed.queries)
    assert all(isinstance(a, str) and a and a == a.strip() for a in parsed.answers)
    if parsed.kind == SEARCH:
        assert parsed.queries and parsed.error is None
    if parsed.kind == INVALID:
        assert isinstance(parsed.error, str) and parsed.error


@settings(max_examples=300, deadline=None)
@given(st.lists(_fragments | st.text(max_size=12), max_size=25).map("".join))
def test_fuzz_tag_soup_never_raises(text):
    _check(parse_turn(text))
    count_queries(text)
    extract_last_answer(text)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.sampled_from(["tool_call", "answer"]), st.text(max_size=10))
def test_fuzz_json_payloads_never_raise(value, tag, prefix):
    text = f"{prefix}<{tag}>{json.dumps(value)}</{tag}>"
    _check(parse_turn(text))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=15).filter(lambda s: s.strip()), min_size=1, max_size=5))
def test_fuzz_valid_query_lists_round_trip(queries):
    parsed = parse_turn(f"<tool_call>{json.dumps(queries)}</tool_call>")
    assert parsed.kind == SEARCH
    assert parsed.queries == tuple(q.strip() for q in queries)
