"""Synthetic scale-up of the retrieval indexes, to estimate size and latency at QAMPARI's ~25M
passages (Wikipedia 2021, ~100-word chunks).

    .venv/bin/python benchmarks/bench_retrieval_scale.py [--sizes 100000,300000,1000000]  (default 100k,300k)
    .venv/bin/python benchmarks/bench_retrieval_scale.py --smoke    (2,000 passages, 16-d vectors)

BM25: a synthetic corpus (Zipf-distributed vocabulary of 200k words, ~70 indexed tokens per
passage, like a 100-word chunk after stopwords) is streamed into a bm25s index, one child process
per size so peak memory is measured cleanly. Reported: build time, peak build RSS, index and doc
store bytes, and single-query latency (p50/p99) with the index loaded in RAM and memory-mapped.
Dense: faiss exact inner-product search (Flat) over random unit vectors (384-d, MiniLM; 768-d is
e5-base) at the same sizes. A least-squares line through the measured points gives the 25M estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import smoke

TARGET = 25_000_000
VOCAB = 200_000
DOC_TOKENS = 70


def _words(n: int) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    out = []
    for i in range(n):
        s, j = [], i
        while True:
            s.append(letters[j % 26])
            j //= 26
            if j == 0:
                break
        out.append("q" + "".join(s) + "x")  # "x" ending: the stemmer leaves the words alone
    return np.array(out)


def _zipf_cdf(n: int, a: float = 1.07) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** a
    return np.cumsum(weights) / weights.sum()


def passages(n: int, seed: int = 0):
    from spader_pipeline.retrieval.corpus import Passage

    rng = np.random.default_rng(seed)
    words, cdf = _words(VOCAB).tolist(), _zipf_cdf(VOCAB)
    for start in range(0, n, 10_000):
        m = min(10_000, n - start)
        lengths = rng.integers(DOC_TOKENS - 20, DOC_TOKENS + 20, size=m)
        ids = np.searchsorted(cdf, rng.random(int(lengths.sum())))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        ids = ids.tolist()
        for i in range(m):
            yield Passage(str(start + i), "", " ".join([words[t] for t in ids[offsets[i]:offsets[i + 1]]]))


def queries(n: int, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    words, cdf = _words(VOCAB), _zipf_cdf(VOCAB)
    out = []
    for _ in range(n):
        ids = np.searchsorted(cdf, rng.uniform(cdf[50], 1.0, size=rng.integers(2, 6)))  # no "stopwords"
        out.append(" ".join(words[ids]))
    return out


def child_build(n: int, out: str, shard_docs: int | None = None) -> dict:
    from spader_pipeline.retrieval.index import build_index

    started = time.perf_counter()
    bm25 = {"stopwords": None, "shard_docs": shard_docs}
    manifest = build_index(passages(n), out, "bm25", {"bm25": bm25}, show_progress=False)
    return {"build_s": time.perf_counter() - started,
            "build_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "index_mb": manifest["sizes"]["index_bytes"] / 1e6, "docstore_mb": manifest["sizes"]["docstore_bytes"] / 1e6}


def child_query(out: str, mmap: bool) -> dict:
    from spader_pipeline.retrieval.index import load_retriever

    started = time.perf_counter()
    searcher = load_retriever(out, mmap=mmap)
    load_s = time.perf_counter() - started
    qs = queries(300)
    for q in qs[:20]:
        searcher.search_hits([q], 5)
    lat = []
    for q in qs:
        t = time.perf_counter()
        searcher.search_hits([q], 5)
        lat.append(time.perf_counter() - t)
    lat_ms = np.asarray(lat) * 1e3
    return {"load_s": load_s, "p50_ms": float(np.percentile(lat_ms, 50)), "p99_ms": float(np.percentile(lat_ms, 99)),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def dense_flat(n: int, dim: int, nq: int = 50) -> dict:
    import faiss

    faiss.omp_set_num_threads(1)  # single-query latency; OpenMP spinning on 2 shared cores only adds noise
    rng = np.random.default_rng(0)
    index = faiss.IndexFlatIP(dim)
    for start in range(0, n, 100_000):
        x = rng.standard_normal((min(100_000, n - start), dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        index.add(x)
    q = rng.standard_normal((nq, dim), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    index.search(q[:2], 5)
    lat = []
    for i in range(nq):
        t = time.perf_counter()
        index.search(q[i : i + 1], 5)
        lat.append(time.perf_counter() - t)
    return {"p50_ms": float(np.median(lat) * 1e3), "bytes_mb": n * dim * 4 / 1e6}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit(xs, ys, at=TARGET) -> float:
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope * at + intercept)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,300000", help="e.g. 100000,300000,1000000")
    parser.add_argument("--dense-dims", default="384,768", help="'' skips the dense part")
    parser.add_argument("--shard-docs", type=int, default=None,
                        help="sharded BM25 build with this many passages per shard (default: one-shot bm25s build)")
    parser.add_argument("--child", nargs="*")
    args = smoke.parse_args(parser, sizes="2000", dense_dims="16")
    if args.child:
        kind, *rest = args.child
        if kind == "build":
            result = child_build(int(rest[0]), rest[1], int(rest[2]) if len(rest) > 2 else None)
        else:
            result = child_query(rest[0], rest[1] == "mmap")
        print(json.dumps(result))
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    build = f"sharded build, {args.shard_docs} passages per shard" if args.shard_docs else "one-shot bm25s build"
    print(f"BM25 synthetic scale-up, {build} (2-core CPU shared with other agents; single-query latency incl. "
          f"doc fetch; load average {os.getloadavg()[0]:.1f})")
    print(f"{'passages':>10} {'build s':>8} {'peak MB':>8} {'index MB':>9} {'docs MB':>8} "
          f"{'RAM p50/p99 ms':>15} {'RAM RSS MB':>10} {'mmap p50/p99 ms':>16} {'mmap RSS MB':>11}")
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            b = run_child("build", str(n), tmp, *([str(args.shard_docs)] if args.shard_docs else []))
            ram = run_child("query", tmp, "ram")
            mm = run_child("query", tmp, "mmap")
        rows.append({"n": n, **b, "ram": ram, "mmap": mm})
        print(f"{n:>10} {b['build_s']:>8.1f} {b['build_peak_rss_mb']:>8.0f} {b['index_mb']:>9.1f} {b['docstore_mb']:>8.1f} "
              f"{ram['p50_ms']:>7.2f}/{ram['p99_ms']:<7.2f} {ram['rss_mb']:>10.0f} {mm['p50_ms']:>8.2f}/{mm['p99_ms']:<7.2f} "
              f"{mm['rss_mb']:>11.0f}", flush=True)
    ns = [r["n"] for r in rows]
    if len(ns) < 2:
        print(f"load average {os.getloadavg()[0]:.1f}; one size only: no linear fit")
        ns = []
    if ns:
        print(f"Linear estimate at {TARGET / 1e6:.0f}M passages: index {fit(ns, [r['index_mb'] for r in rows]) / 1e3:.1f} GB, "
          f"doc store {fit(ns, [r['docstore_mb'] for r in rows]) / 1e3:.1f} GB, build {fit(ns, [r['build_s'] for r in rows]) / 3600:.1f} h, "
          f"build peak RSS {fit(ns, [r['build_peak_rss_mb'] for r in rows]) / 1e3:.0f} GB, "
          f"query p50 {fit(ns, [r['ram']['p50_ms'] for r in rows]):.0f} ms (RAM) / "
          f"{fit(ns, [r['mmap']['p50_ms'] for r in rows]):.0f} ms (mmap, warm page cache)")

    for dim in (int(d) for d in args.dense_dims.split(",") if d):
        pts = [(n, dense_flat(n, dim)) for n in sizes]
        for n, d in pts:
            print(f"faiss Flat {dim}-d {n:>9} vectors: {d['bytes_mb']:8.0f} MB, single-query p50 {d['p50_ms']:7.2f} ms")
        print(f"  estimate at {TARGET / 1e6:.0f}M: {TARGET * dim * 4 / 1e9:.0f} GB of vectors, "
              f"p50 {fit([n for n, _ in pts], [d['p50_ms'] for _, d in pts]):.0f} ms per single query (CPU)")


if __name__ == "__main__":
    main()
