"""In-process search (``LocalSearch``): the concurrent searches of an event loop answered in batches, each
exactly what the searcher answers one call at a time, a refused or failed call reaching its own caller."""

from __future__ import annotations

import asyncio

import pytest

from spader_pipeline.retrieval.index import load_retriever
from spader_pipeline.retrieval.service import LocalSearch
from spader_pipeline.retrieval.wire import RequestError

CALLS = [(["capital city"], 3, None), (["river", "mountain range"], 2, None), (["king of France"], 5, 900),
         (["capital city"], 1, None), (["zzzz unmatched"], 3, None)]


class _Counted:
    """The searcher with its first-stage calls counted (the real retriever underneath)."""

    def __init__(self, searcher, fail: BaseException | None = None) -> None:
        self.searcher, self.fail, self.calls = searcher, fail, []
        retriever = searcher.retriever

        class Retriever:
            name, num_docs = retriever.name, retriever.num_docs

            def search(inner, queries, k):
                self.calls.append(list(queries))
                if self.fail is not None:
                    raise self.fail
                return retriever.search(queries, k)

        searcher.retriever = Retriever()


@pytest.fixture()
def searcher(bm25_index):
    searcher = load_retriever(bm25_index)
    yield searcher
    searcher.close()


def test_a_round_of_concurrent_searches_is_one_first_stage_call_of_its_distinct_queries_with_each_call_s_own_answer(
        searcher):
    expected = [searcher.respond(queries, topk, max_chars) for queries, topk, max_chars in CALLS]
    counted = _Counted(searcher)
    local = LocalSearch(searcher)

    async def round_():
        return await asyncio.gather(*(local.search(q, topk=k, max_chars=m) for q, k, m in CALLS))

    assert asyncio.run(round_()) == expected
    # "capital city" is asked twice (top 3 and top 1): searched once, each call cut to its own top k
    assert counted.calls == [list(dict.fromkeys(q for queries, _, _ in CALLS for q in queries))]
    assert len(counted.calls[0]) == sum(len(queries) for queries, _, _ in CALLS) - 1
    assert asyncio.run(round_()) == expected  # another event loop (asyncio.run again), its own batches
    assert len(counted.calls) == 2


def test_searches_awaited_one_after_another_each_run_alone(searcher):
    expected = [searcher.respond(q, k, m) for q, k, m in CALLS[:3]]
    counted = _Counted(searcher)
    local = LocalSearch(searcher)

    async def one_by_one():
        return [await local.search(q, topk=k, max_chars=m) for q, k, m in CALLS[:3]]

    assert asyncio.run(one_by_one()) == expected
    assert [len(c) for c in counted.calls] == [1, 2, 1]


def test_a_refused_call_gets_its_error_and_the_others_their_answers(searcher):
    local = LocalSearch(searcher)

    async def round_():
        return await asyncio.gather(local.search(["capital city"], topk=3, max_chars=20), local.search(["river"], topk=2),
                                    return_exceptions=True)

    refused, answered = asyncio.run(round_())
    assert isinstance(refused, RequestError) and refused.status == 422
    assert answered == searcher.respond(["river"], 2)


def test_a_failed_batch_reaches_every_caller_with_its_exception(searcher):
    """A missing module must stop a run (``observe_search`` lets ``ImportError`` through), not become an
    error observation per trajectory."""
    _Counted(searcher, fail=ImportError("no module named scipy"))
    local = LocalSearch(searcher)

    async def round_():
        return await asyncio.gather(*(local.search(["capital"]) for _ in range(3)), return_exceptions=True)

    errors = asyncio.run(round_())
    assert all(isinstance(e, ImportError) for e in errors)


def test_a_cancelled_caller_leaves_the_batch_to_the_others(searcher):
    local = LocalSearch(searcher)

    async def round_():
        first = asyncio.ensure_future(local.search(["capital city"]))
        second = asyncio.ensure_future(local.search(["river"], topk=2))
        await asyncio.sleep(0)  # both submitted
        first.cancel()
        return await asyncio.gather(first, second, return_exceptions=True)

    cancelled, answered = asyncio.run(round_())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert answered == searcher.respond(["river"], 2)
