"""BM25 query throughput on the embedded corpus (10,033 Wikipedia summaries): our bm25s-backed
retriever against rank-bm25 (the straightforward implementation), same tokens, same k, one run.

    .venv/bin/python benchmarks/bench_retrieval_bm25.py [--queries 300] [--repeats 5] [--smoke]

Reports the median over ``--repeats`` runs of queries/s for: ours (top-k rows), ours end to end
(rows + passages from the doc store), bm25s' own ``retrieve`` on the same index, and rank-bm25's
``BM25Okapi.get_scores`` + top-k. Also checks that ours and rank-bm25 agree on the top passage.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402
from bench_retrieval_common import embedded_passages, embedded_queries  # noqa: E402

from spader_pipeline.retrieval.bm25 import passage_text  # noqa: E402
from spader_pipeline.retrieval.index import build_index, load_retriever  # noqa: E402


def timed(fn, queries, repeats):
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        for q in queries:
            fn(q)
        rates.append(len(queries) / (time.perf_counter() - started))
    return statistics.median(rates), rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rank-bm25-queries", type=int, default=100, help="rank-bm25 is slow: fewer queries")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, default=5)
    args = smoke.parse_args(parser, queries=20, rank_bm25_queries=5, repeats=1)

    passages = embedded_passages()
    queries = embedded_queries(passages, args.queries)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        build_index(passages, tmp, "bm25", show_progress=False)
        build_s = time.perf_counter() - started
        searcher = load_retriever(tmp)
        retriever = searcher.retriever
        k = args.k

        ours_rate, ours_all = timed(lambda q: retriever.search([q], k), queries, args.repeats)
        e2e_rate, _ = timed(lambda q: searcher.search_hits([q], k), queries, args.repeats)

        import bm25s

        lib = bm25s.BM25.load(str(Path(tmp) / "bm25"))
        tok = retriever.tokenizer

        def bm25s_retrieve(q):
            ids = tok.ids(q)
            if ids:
                lib.retrieve([ids], k=k, show_progress=False)

        lib_rate, _ = timed(bm25s_retrieve, queries, args.repeats)

        from rank_bm25 import BM25Okapi

        corpus_tokens = [tok.tokens(passage_text(p, True)) for p in passages]
        okapi = BM25Okapi(corpus_tokens, k1=0.9, b=0.4)

        def rank_bm25_search(q):
            scores = okapi.get_scores(tok.tokens(q))
            top = np.argpartition(-scores, k)[:k]
            return top[np.argsort(-scores[top])]

        few = queries[: args.rank_bm25_queries]
        okapi_rate, okapi_all = timed(rank_bm25_search, few, args.repeats)

        agree = sum(
            int(retriever.search([q], 1)[0][0][0]) == int(rank_bm25_search(q)[0])
            for q in few if retriever.search([q], 1)[0][0].size
        )
        searcher.close()

    print(f"corpus: {len(passages)} passages, build {build_s:.2f}s; {len(queries)} queries, k={k}, "
          f"median of {args.repeats} runs (2-core CPU shared with other agents)")
    print(f"  ours (bm25s index, sparse scoring)   {ours_rate:10.0f} q/s   runs={[round(r) for r in ours_all]}")
    print(f"  ours end to end (+doc store)         {e2e_rate:10.0f} q/s")
    print(f"  bm25s.BM25.retrieve, same index      {lib_rate:10.0f} q/s")
    print(f"  rank-bm25 BM25Okapi ({len(few)} queries)   {okapi_rate:10.1f} q/s   runs={[round(r, 1) for r in okapi_all]}")
    print(f"  speed-up ours / rank-bm25: {ours_rate / okapi_rate:.0f}x "
          f"(end to end {e2e_rate / okapi_rate:.0f}x); top-1 agreement {agree}/{len(few)} "
          f"(rank-bm25's Okapi idf differs from Lucene's)")


if __name__ == "__main__":
    main()
