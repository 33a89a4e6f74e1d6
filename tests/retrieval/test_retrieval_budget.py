"""The SPADER character budget (docs/retrieval.md) must hold for every rendering a client shows."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spader_pipeline.retrieval.budget import (
    BudgetTooSmall,
    apply_budget,
    entry_cost,
    render,
    rendered_length,
    spader_body,
    truncation_warning,
)

text = st.text(st.characters(codec="utf-8"), max_size=300)
doc = st.fixed_dictionaries({"id": st.text(max_size=8), "title": text, "contents": text})
scored = st.builds(lambda d, s: {"document": d, "score": s}, doc, st.floats(-50, 50, allow_nan=False))
entry = st.one_of(doc, scored)


def reference_truncate(queries, candidates, max_chars):
    """The reference server's walk (KhanCold/spader): entries measured at top-level indentation, stop at
    the first candidate that does not fit."""
    total = len(json.dumps([{"query": q, "documents": []} for q in queries], indent=2, ensure_ascii=False))
    order = sorted(((r, q) for q, docs in enumerate(candidates) for r in range(len(docs))))
    kept = [[] for _ in queries]
    truncated = False
    for r, q in order:
        cost = len(json.dumps(candidates[q][r], indent=2, ensure_ascii=False))
        if total + cost > max_chars:
            truncated = True
            break
        total += cost
        kept[q].append(candidates[q][r])
    return spader_body(queries, kept, truncation_warning(max_chars) if truncated else None)


def eval_client_text(body):
    """What SPADER's evaluation client shows: the result list plus the warning line."""
    out = json.dumps(body["result"], indent=2, ensure_ascii=False)
    return out + ("\n" + body["truncation_warning"] if "truncation_warning" in body else "")


@settings(max_examples=300, deadline=None)
@given(
    queries=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=6),
    docs=st.lists(st.lists(entry, max_size=6), min_size=6, max_size=6),
    max_chars=st.integers(1, 6000),
)
def test_budget_holds_for_every_rendering(queries, docs, max_chars):
    candidates = docs[: len(queries)]
    try:
        body = apply_budget(queries, candidates, max_chars)
    except BudgetTooSmall:
        skeleton = spader_body(queries, [[] for _ in queries], truncation_warning(max_chars))
        assert len(render(skeleton)) > max_chars
        return
    assert len(render(body)) <= max_chars  # training client: whole JSON at indent 2
    assert len(eval_client_text(body)) <= max_chars  # evaluation client
    assert len(json.dumps(body, ensure_ascii=False)) <= max_chars  # compact wire form
    for result, cands in zip(body["result"], candidates, strict=True):
        kept = result["documents"]
        assert kept == cands[: len(kept)]  # every query keeps a rank prefix, in order
    dropped = sum(len(c) for c in candidates) - sum(len(r["documents"]) for r in body["result"])
    assert ("truncation_warning" in body) == (dropped > 0)


@settings(max_examples=200, deadline=None)
@given(queries=st.lists(st.text(max_size=30), min_size=1, max_size=5),
       docs=st.lists(st.lists(entry, max_size=5), min_size=5, max_size=5))
def test_entry_costs_are_exact(queries, docs):
    candidates = docs[: len(queries)]
    skeleton = len(render(spader_body(queries, [[] for _ in queries], None)))
    predicted = skeleton + sum(entry_cost(e, first=(r == 0)) for c in candidates for r, e in enumerate(c))
    assert predicted == len(render(spader_body(queries, candidates, None)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(value=json_values)
def test_rendered_length_equals_the_real_rendering(value):
    assert rendered_length(value) == len(json.dumps(value, indent=2, ensure_ascii=False))


def _docs(n_queries, per_query, size):
    return [[{"id": f"{q}-{r}", "title": f"T{q}{r}", "contents": "w" * size} for r in range(per_query)]
            for q in range(n_queries)]


@pytest.mark.parametrize("n_queries", [1, 2, 3, 5, 10])
def test_reference_walk_overshoots_where_ours_holds(n_queries):
    queries = [f"query number {i}" for i in range(n_queries)]
    candidates = _docs(n_queries, 5, 640)  # ~700-character passages, as SPADER's server returns
    ours = apply_budget(queries, candidates, 10000)
    assert len(render(ours)) <= 10000
    reference = reference_truncate(queries, candidates, 10000)
    if "truncation_warning" in reference:
        assert len(render(reference)) > 10000  # the defect this module fixes


def test_round_robin_spreads_passages_evenly():
    queries = ["a", "b", "c", "d", "e"]
    body = apply_budget(queries, _docs(5, 5, 640), 10000)
    kept = [len(r["documents"]) for r in body["result"]]
    assert max(kept) - min(kept) <= 1 and kept == sorted(kept, reverse=True)
    assert body["truncation_warning"] == "System Note: Retrieval results truncated at 10000 characters."


def test_a_long_passage_closes_its_query_but_not_the_others():
    candidates = [[{"id": "big", "title": "", "contents": "x" * 5000}], _docs(1, 3, 100)[0]]
    body = apply_budget(["q1", "q2"], candidates, 2000)
    assert body["result"][0]["documents"] == []
    assert len(body["result"][1]["documents"]) == 3


def test_no_budget_and_no_truncation_when_everything_fits():
    candidates = _docs(2, 2, 50)
    assert "truncation_warning" not in apply_budget(["a", "b"], candidates, 100000)
    assert apply_budget(["a", "b"], candidates, 0) == spader_body(["a", "b"], candidates, None)
    assert apply_budget(["a", "b"], candidates, None) == spader_body(["a", "b"], candidates, None)


def test_budget_smaller_than_the_skeleton_is_refused():
    with pytest.raises(BudgetTooSmall, match="smaller than the response skeleton"):
        apply_budget(["a long query " * 20], [[]], 50)
