"""Dense retrieval on CPU with the embedded all-MiniLM-L6-v2 encoder: passage encoding throughput,
single-query latency (encode + faiss search) for Flat and HNSW32, and HNSW's recall of Flat's
top 5.

    .venv/bin/python benchmarks/bench_retrieval_dense.py [--passages 500] [--queries 100] [--repeats 3] [--smoke]
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

from spader_pipeline.retrieval.index import build_index, load_retriever  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passages", type=int, default=500)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch/faiss threads at query time")
    args = smoke.parse_args(parser, passages=20, queries=5, repeats=1)
    passages = embedded_passages()[: args.passages]
    queries = embedded_queries(passages, args.queries, seed=2)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("Flat", "HNSW32"):
            out = Path(tmp) / kind
            started = time.perf_counter()
            build_index(passages, out, "dense", {"dense": {"index_type": kind}}, show_progress=False)
            build_s = time.perf_counter() - started
            searcher = load_retriever(out, num_threads=args.threads)
            searcher.search(queries[:5], 5)  # warm-up
            medians, tops = [], []
            for _ in range(args.repeats):
                lat = []
                for q in queries:
                    t = time.perf_counter()
                    tops.append(searcher.retriever.search([q], 5)[0][0])
                    lat.append(time.perf_counter() - t)
                medians.append(float(np.median(lat) * 1e3))
            results[kind] = {"build_s": build_s, "p50_ms": statistics.median(medians), "tops": tops[: len(queries)]}
            searcher.close()
    recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / max(len(a), 1)
                      for a, b in zip(results["Flat"]["tops"], results["HNSW32"]["tops"], strict=True)])
    print(f"dense (all-MiniLM-L6-v2, CPU, 2 shared cores), {len(passages)} passages, {len(queries)} queries, "
          f"median of {args.repeats} runs")
    for kind, r in results.items():
        print(f"  {kind:7s} (query threads {args.threads}) build (encode + index) {r['build_s']:6.1f} s = {len(passages) / r['build_s']:6.0f} passages/s;"
              f" single query (encode + search) p50 {r['p50_ms']:6.2f} ms")
    print(f"  HNSW32 recall of Flat top-5: {recall:.3f}")


if __name__ == "__main__":
    main()
