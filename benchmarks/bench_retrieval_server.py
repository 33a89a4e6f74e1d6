"""Served BM25 search over loopback: requests/s and p50/p99 latency at 1, 8 and 32 concurrent
clients, error count, and the server's memory before/after.

    .venv/bin/python benchmarks/bench_retrieval_server.py [--requests 4000] [--repeats 3]

The server (``spader-retrieval serve``, one uvicorn process) indexes the embedded corpus (10,033
Wikipedia summaries). The load generator is a minimal keep-alive HTTP/1.1 client on asyncio streams
(one connection per simulated client) so that the measurement is not dominated by client-side
overhead; it runs on the same 2 shared cores as the server. Each request is a single query;
``--style spader`` sends SPADER's training body (with the character budget), ``search_r1`` VERL's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from bench_retrieval_common import embedded_passages, embedded_queries  # noqa: E402

from spader_pipeline.retrieval import running_service  # noqa: E402
from spader_pipeline.retrieval.index import build_index  # noqa: E402


def body_for(query: str, style: str) -> bytes:
    if style == "spader":
        payload = {"queries": [query], "topk": 5, "initial_k": 50, "max_chars": 10000, "use_reranker": None}
    else:
        payload = {"queries": [query], "topk": 5, "return_scores": True}
    return json.dumps(payload).encode()


async def client_loop(host, port, bodies, latencies, errors):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for body in bodies:
            request = (b"POST /retrieve HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            payload = await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if status != 200 or not payload.startswith(b'{"result":'):
                errors.append(status)
    finally:
        writer.close()


async def load(base_url: str, queries: list[str], concurrency: int, total: int, style: str):
    host, port = base_url.removeprefix("http://").split(":")
    bodies = [body_for(queries[i % len(queries)], style) for i in range(total)]
    shares = [bodies[i::concurrency] for i in range(concurrency)]
    latencies: list[float] = []
    errors: list[int] = []
    started = time.perf_counter()
    await asyncio.gather(*(client_loop(host, int(port), s, latencies, errors) for s in shares))
    elapsed = time.perf_counter() - started
    lat = np.asarray(latencies) * 1e3
    return {"rps": total / elapsed, "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "errors": len(errors) + (total - len(latencies))}


def server_process(base_url: str) -> psutil.Process:
    port = int(base_url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return psutil.Process(conn.pid)
    raise RuntimeError("server process not found")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=4000, help="requests per concurrency level and run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--style", choices=("search_r1", "spader"), default="search_r1")
    parser.add_argument("--set", action="append", default=[], help="server setting, e.g. search_threads=2")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    passages = embedded_passages()
    queries = embedded_queries(passages, 2000, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        build_index(passages, tmp, "bm25", show_progress=False)
        extra = [a for kv in args.set for a in ("--set", kv)]
        with running_service(tmp, extra_args=extra) as base_url:
            proc = server_process(base_url)
            asyncio.run(load(base_url, queries, 8, 1000, args.style))  # warm-up
            rss_before = proc.memory_info().rss
            cpu_before = sum(proc.cpu_times()[:2])
            runs: dict[int, list[dict]] = {c: [] for c in levels}
            total = 0
            for _ in range(args.repeats):
                for c in levels:
                    runs[c].append(asyncio.run(load(base_url, queries, c, args.requests, args.style)))
                    total += args.requests
            rss_after = proc.memory_info().rss
            cpu_per_request_us = (sum(proc.cpu_times()[:2]) - cpu_before) / total * 1e6

    print(f"served BM25 over loopback, {args.style} single-query requests, {args.requests} requests per level "
          f"per run, median of {args.repeats} runs; 2-core CPU shared with the load generator and other agents")
    errors = 0
    for c in levels:
        med = {key: statistics.median(r[key] for r in runs[c]) for key in ("rps", "p50_ms", "p99_ms")}
        errs = sum(r["errors"] for r in runs[c])
        errors += errs
        print(f"  {c:3d} clients: {med['rps']:7.0f} req/s   p50 {med['p50_ms']:6.2f} ms   p99 {med['p99_ms']:6.2f} ms"
              f"   errors {errs}")
    print(f"  total requests {total}, errors {errors}; server RSS {rss_before / 2**20:.1f} MiB -> "
          f"{rss_after / 2**20:.1f} MiB ({(rss_after - rss_before) / 2**20:+.1f} MiB)")
    print(f"  server CPU time per request: {cpu_per_request_us:.0f} us (user+system; a load-independent cost: "
          f"one free core would serve ~{1e6 / cpu_per_request_us:.0f} req/s)")


if __name__ == "__main__":
    main()
