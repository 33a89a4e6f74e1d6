"""Served BM25 search over loopback: server CPU per request next to requests/s, p50/p99 latency and
errors, for the current service and (``--baseline-rev``) the service of another git revision, in
one run, alternating.

    .venv/bin/python benchmarks/bench_retrieval_server.py [--clients 32] [--seconds 10] [--repeats 3]
        [--style search_r1|spader] [--client auto|wrk|python] [--baseline-rev 9ea9b85] [--floor] [--smoke]

Each server (``spader-retrieval serve``, one uvicorn process) serves the embedded corpus (10,033
Wikipedia summaries); every request carries one query. **Server CPU per request** is the server
process's own user+system CPU time over a run divided by the requests it answered (psutil on the
server pid), so a slow load client cannot hide the server's cost. The load client is ``wrk``
(compiled, one thread, Debian package ``wrk``) when it is installed, otherwise a multi-process
keep-alive client on asyncio streams; its own CPU per request is printed too. Client and server
share the same 2 cores (and the machine with other agents): req/s and latency depend on that load
(``os.getloadavg()`` is printed per run), CPU per request much less.

``--floor`` shows where the floor is, in the same run: a do-nothing ASGI app under the same
uvicorn (uvloop + httptools) that answers every request with a fixed body of the service's own size
(the HTTP cost no ASGI service can go below), and the request's own work measured in process
(parse + validate, one batched first-stage call, render; batches of ``--work-batch`` requests, as
the service coalesces them under load). Their sum is what a service of this design costs at least.

The baseline revision is exported with ``git archive`` into a temporary folder and put first on
``PYTHONPATH`` for its server process (the index folder format is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402
from bench_retrieval_common import embedded_passages, embedded_queries  # noqa: E402

from spader_pipeline.local_servers import free_port, stop_process_group, wait_healthy  # noqa: E402
from spader_pipeline.retrieval import running_service  # noqa: E402
from spader_pipeline.retrieval.index import build_index  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def body_for(query: str, style: str) -> bytes:
    if style == "spader":
        payload = {"queries": [query], "topk": 5, "initial_k": 50, "max_chars": 10000, "use_reranker": None}
    else:
        payload = {"queries": [query], "topk": 5, "return_scores": True}
    return json.dumps(payload).encode()


# ----------------------------------------------------------------------------- python load client


async def _connection(host, port, bodies, deadline, latencies, errors):
    reader, writer = await asyncio.open_connection(host, port)
    i = 0
    try:
        while time.perf_counter() < deadline:
            body = bodies[i % len(bodies)]
            i += 1
            request = (b"POST /retrieve HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
            payload = await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if head[9:12] != b"200" or not payload.startswith(b'{"result":'):
                errors.append(head[9:12])
    finally:
        writer.close()


def _client_process(args):
    host, port, bodies, connections, seconds = args
    latencies, errors = [], []

    async def run():
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(_connection(host, port, bodies[c::connections] or bodies, deadline, latencies, errors)
                               for c in range(connections)))

    asyncio.run(run())
    return latencies, len(errors)


def python_load(url, bodies, clients, seconds, processes=2):
    host, port = url.removeprefix("http://").split(":")
    per = [clients // processes + (1 if p < clients % processes else 0) for p in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.map(_client_process, [(host, int(port), bodies[p::processes], n, seconds)
                                           for p, n in enumerate(per) if n])
    lat = np.concatenate([np.asarray(p[0]) for p in parts]) * 1e3
    return {"requests": int(lat.size), "errors": sum(p[1] for p in parts),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


# ----------------------------------------------------------------------------- wrk load client

_WRK_SCRIPT = """
local bodies = {}
for line in io.lines("%s") do bodies[#bodies + 1] = line end
local i = 0
request = function()
  i = i + 1
  return wrk.format("POST", "/retrieve", {["Content-Type"] = "application/json"}, bodies[(i %% #bodies) + 1])
end
"""


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def wrk_load(url, bodies_file, script, clients, seconds):
    out = subprocess.run(["wrk", "-t1", f"-c{clients}", f"-d{seconds}s", "--latency", "-s", script, url],
                         capture_output=True, text=True, check=True).stdout
    lat = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)", out, re.M))
    def parse(x):
        m = re.match(r"([\d.]+)(us|ms|s|m)$", x)
        return _ms(m.group(1), m.group(2))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (sum(map(int, sock.groups())) if sock else 0)
    return {"requests": requests, "errors": errors, "p50_ms": parse(lat["50"]), "p99_ms": parse(lat["99"])}


# ----------------------------------------------------------------------------- harness


def server_process(base_url: str) -> psutil.Process:
    port = int(base_url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return psutil.Process(conn.pid)
    raise RuntimeError("server process not found")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(url, proc, load, seconds):
    cpu0 = sum(proc.cpu_times()[:2])
    client0 = children_cpu()
    load0 = os.getloadavg()[0]
    started = time.perf_counter()
    result = load()
    elapsed = time.perf_counter() - started
    server_cpu = sum(proc.cpu_times()[:2]) - cpu0
    n = max(result["requests"], 1)
    return {**result, "rps": result["requests"] / elapsed, "server_cpu_us": server_cpu / n * 1e6,
            "client_cpu_us": (children_cpu() - client0) / n * 1e6, "load": (load0 + os.getloadavg()[0]) / 2}


# ----------------------------------------------------------------------------- the floor

_FLOOR_APP = """
import sys, uvicorn
body = open(sys.argv[2], "rb").read()
headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:  # read the request body, as any service must
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False,
            timeout_keep_alive=30, loop="auto", http="auto", lifespan="off", proxy_headers=False,
            server_header=False, date_header=False)
"""


@contextmanager
def floor_service(body_file: Path):
    """A do-nothing ASGI app under the service's uvicorn settings, answering with ``body_file``."""
    port = free_port("127.0.0.1")
    process = subprocess.Popen([sys.executable, "-c", _FLOOR_APP, str(port), str(body_file)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, process, name="floor app")
        yield url
    finally:
        stop_process_group(process)


def request_work_us(index_dir: Path, bodies: list[bytes], batch: int, repeats: int) -> float:
    """CPU µs per request of the service's own work, in process: parse + validate each body, one
    batched first-stage call per ``batch`` requests, render each answer (what a worker thread does)."""
    import orjson

    from spader_pipeline.retrieval.index import load_retriever
    from spader_pipeline.retrieval.schemas import ServiceSettings
    from spader_pipeline.retrieval.service import SearchBatcher
    from spader_pipeline.retrieval.wire import parse_request

    settings = ServiceSettings()
    searcher = load_retriever(index_dir)
    batcher = SearchBatcher(searcher, render=orjson.dumps)
    try:
        times = []
        for _ in range(repeats):
            started, n = time.process_time(), 0
            for start in range(0, len(bodies) - batch + 1, batch):
                out = batcher.run_batch([parse_request(b, settings) for b in bodies[start : start + batch]])
                assert all(isinstance(o, bytes) for o in out)
                n += batch
            times.append((time.process_time() - started) / n * 1e6)
        return statistics.median(times)
    finally:
        searcher.close()


def _post(url: str, body: bytes) -> bytes:
    """The service's raw answer to one request (proxies ignored, as ``wait_healthy`` does: loopback)."""
    import httpx

    response = httpx.post(f"{url}/retrieve", content=body, headers={"Content-Type": "application/json"},
                          timeout=30, trust_env=False)
    response.raise_for_status()
    return response.content


def export_revision(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=int, default=10, help="per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--style", choices=("search_r1", "spader"), default="search_r1")
    parser.add_argument("--client", choices=("auto", "wrk", "python"), default="auto")
    parser.add_argument("--baseline-rev", help="also measure the service of this git revision (e.g. 9ea9b85)")
    parser.add_argument("--set", action="append", default=[], help="server setting, e.g. batch_window_ms=1")
    parser.add_argument("--floor", action="store_true", help="also measure a do-nothing ASGI app and the "
                        "request work in process (where the floor is)")
    parser.add_argument("--work-batch", type=int, default=16, help="requests per batch for the in-process work")
    args = smoke.parse_args(parser, clients=2, seconds=1, repeats=1, client="python", floor=True)
    client = args.client if args.client != "auto" else ("wrk" if shutil.which("wrk") else "python")

    passages = embedded_passages()
    queries = embedded_queries(passages, 2000, seed=1)
    bodies = [body_for(q, args.style) for q in queries]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        build_index(passages, tmp / "index", "bm25", show_progress=False)
        (tmp / "bodies.jsonl").write_bytes(b"\n".join(bodies) + b"\n")
        (tmp / "load.lua").write_text(_WRK_SCRIPT % (tmp / "bodies.jsonl"))
        servers = {}
        if args.baseline_rev:
            src = export_revision(args.baseline_rev, tmp)
            env = {"PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            servers[f"baseline {args.baseline_rev}"] = stack.enter_context(
                running_service(tmp / "index", extra_args=[], env=env))
        extra = [a for kv in args.set for a in ("--set", kv)]
        servers["current"] = stack.enter_context(running_service(tmp / "index", extra_args=extra))
        if args.floor:  # the do-nothing app answers with a real response of the service, byte for byte
            (tmp / "response.json").write_bytes(_post(servers["current"], bodies[0]))
            servers["floor: do-nothing ASGI"] = stack.enter_context(floor_service(tmp / "response.json"))

        def load_for(url):
            if client == "wrk":
                return lambda: wrk_load(url, tmp / "bodies.jsonl", str(tmp / "load.lua"), args.clients, args.seconds)
            return lambda: python_load(url, bodies, args.clients, args.seconds)

        procs = {name: server_process(url) for name, url in servers.items()}
        for name, url in servers.items():  # warm-up
            measure(url, procs[name], load_for(url) if client == "wrk" else
                    (lambda url=url: python_load(url, bodies[:500], 8, 2)), 2)
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for _ in range(args.repeats):
            for name, url in servers.items():
                runs[name].append(measure(url, procs[name], load_for(url), args.seconds))
                print(f"  {name:>18}: " + ", ".join(f"{k} {v:.3g}" for k, v in runs[name][-1].items()), flush=True)
        work = request_work_us(tmp / "index", bodies, args.work_batch, args.repeats) if args.floor else None

    print(f"\nserved BM25 over loopback, {args.style} single-query requests, {args.clients} clients, "
          f"load client {client}, {args.seconds} s per run, median of {args.repeats} runs (2 shared cores)")
    print(f"{'server':>20} {'server CPU/req us':>18} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'errors':>7} "
          f"{'client CPU/req us':>18} {'load avg':>9}")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("server_cpu_us", "rps", "p50_ms", "p99_ms",
                                                                "client_cpu_us", "load")}
        print(f"{name:>20} {med['server_cpu_us']:>18.0f} {med['rps']:>7.0f} {med['p50_ms']:>7.2f} {med['p99_ms']:>7.2f} "
              f"{sum(r['errors'] for r in rs):>7d} {med['client_cpu_us']:>18.0f} {med['load']:>9.1f}")
    if work is not None:
        floor = statistics.median(r["server_cpu_us"] for r in runs["floor: do-nothing ASGI"])
        print(f"\nrequest work in process (parse, batched search of {args.work_batch} requests, render): "
              f"{work:.0f} us/request CPU (median of {args.repeats}); do-nothing ASGI {floor:.0f} us; "
              f"sum {work + floor:.0f} us = this design's floor without the event-loop/thread hand-off")


if __name__ == "__main__":
    main()
