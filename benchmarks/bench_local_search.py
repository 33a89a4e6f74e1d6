"""A rollout round's searches in process: one worker-thread hand-off per call against ``LocalSearch``'s batches.

A rollout advances its trajectories in lock-step rounds; after each round's model turns every trajectory
that searches calls ``search.search(queries)`` at once (``asyncio.gather`` in ``agent.rollout``), and
with one GPU's 768 trajectories the device waits for that round of searches. The straightforward
in-process search hands each call to a worker thread (``asyncio.to_thread(searcher.respond, ...)``, what
``LocalSearch`` did): 768 hand-offs a round, each thread then contending for the interpreter with the
others. ``LocalSearch`` answers a round's calls as the HTTP service answers concurrent requests: one
batch, one first-stage call (one sparse product for BM25) in one worker thread, then each call's own
response and character budget (``retrieval.service.SearchBatcher``). The answers are checked equal.

BM25 over the embedded corpus (10,033 Wikipedia summaries), ``--calls`` calls of one query or, one in
``--two-query-share``, two (as the agent's tool calls carry), the one-GPU run's ``topk`` 3; interleaved
medians over ``--repeats``.

    python benchmarks/bench_local_search.py [--calls 768] [--repeats 7] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile

import smoke
from bench_retrieval_common import embedded_passages, embedded_queries
from timing import interleaved_medians, print_medians

from spader_pipeline.retrieval import build_index
from spader_pipeline.retrieval.index import load_retriever
from spader_pipeline.retrieval.service import LocalSearch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=768)
    parser.add_argument("--two-query-share", type=float, default=0.3)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    args = smoke.parse_args(parser, calls=16, repeats=1)
    passages = embedded_passages()[: 500 if args.smoke else None]
    rng = random.Random(0)
    pool = iter(embedded_queries(passages, 2 * args.calls))
    calls = [[next(pool)] + ([next(pool)] if rng.random() < args.two_query_share else []) for _ in range(args.calls)]
    with tempfile.TemporaryDirectory() as tmp:
        build_index(passages, tmp, "bm25", show_progress=False)
        searcher = load_retriever(tmp)
        try:
            local = LocalSearch(searcher)

            async def thread_per_call():
                return await asyncio.gather(*(asyncio.to_thread(searcher.respond, q, args.topk) for q in calls))

            async def batched():
                return await asyncio.gather(*(local.search(q, topk=args.topk) for q in calls))

            ways = {"a thread per call": lambda: asyncio.run(thread_per_call()),
                    "LocalSearch's batches": lambda: asyncio.run(batched())}
            medians, results = interleaved_medians(ways, args.repeats)
        finally:
            searcher.close()
    assert results["a thread per call"] == results["LocalSearch's batches"], "the two ways answered differently"
    queries = sum(map(len, calls))
    print(f"a round of {args.calls} search calls ({queries} queries, top {args.topk}, {len(passages)} passages), "
          f"median of {args.repeats}:")
    print_medians(medians, "a thread per call", "LocalSearch's batches")


if __name__ == "__main__":
    main()
