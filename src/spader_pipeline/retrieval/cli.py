"""``spader-retrieval``: build an index folder, or serve one over HTTP.

    spader-retrieval build --corpus data/03_primary/corpus.jsonl --out data/06_models/retrieval/bm25 --method bm25
    spader-retrieval serve --index data/06_models/retrieval/bm25 [--host 127.0.0.1] [--port 8000]

Method parameters come from a YAML/JSON file (``--params``, same keys as the ``index_build``
block of ``conf/base/parameters_index_build.yml``) and/or ``--set key.sub=value`` overrides.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml


def _set(params: dict[str, Any], assignment: str) -> None:
    key, _, raw = assignment.partition("=")
    if not key or not _:
        raise SystemExit(f"--set expects key.sub=value, got {assignment!r}")
    node = params
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(raw)


def _load_params(path: str | None, assignments: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if path:
        params = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    for assignment in assignments:
        _set(params, assignment)
    return params


def _build(args: argparse.Namespace) -> int:
    from spader_pipeline.retrieval.index import build_index_from_file

    params = _load_params(args.params, args.set)
    manifest = build_index_from_file(args.corpus, args.out, args.method, params, show_progress=not args.quiet)
    print(json.dumps(manifest, indent=2))  # noqa: T201 - the command's output
    return 0


def _serve(args: argparse.Namespace) -> int:
    from spader_pipeline.retrieval.index import load_retriever
    from spader_pipeline.retrieval.schemas import ServiceSettings
    from spader_pipeline.retrieval.server import serve

    overrides = _load_params(args.settings, args.set)
    settings = ServiceSettings(**{**overrides, "host": args.host, "port": args.port})
    rerank = {"model_path": args.reranker} if args.reranker else None
    searcher = load_retriever(args.index, mmap=True if args.mmap else None, rerank=rerank)
    try:
        serve(searcher, settings)
    finally:
        searcher.close()
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="spader-retrieval", description=__doc__.splitlines()[0])
    sub = root.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="index a JSON-lines corpus {id, title, contents}")
    build.add_argument("--corpus", required=True, help="JSON-lines corpus file")
    build.add_argument("--out", required=True, help="index folder to write")
    build.add_argument("--method", choices=("bm25", "dense", "lucene"), default="bm25",
                       help="lucene needs pyserini and Java 21 (not installed by default)")
    build.add_argument("--params", help="YAML/JSON file with bm25:/dense:/rerank: blocks")
    build.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one parameter, e.g. bm25.k1=1.2 or dense.index_type=HNSW32")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.set_defaults(func=_build)
    srv = sub.add_parser("serve", help="serve an index folder over HTTP")
    srv.add_argument("--index", required=True, help="index folder (with manifest.json)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--mmap", action="store_true", help="memory-map the index instead of loading it")
    srv.add_argument("--reranker", help="local cross-encoder folder (enables reranking)")
    srv.add_argument("--settings", help="YAML/JSON file with ServiceSettings fields (limits, defaults)")
    srv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override one service setting, e.g. max_topk=50")
    srv.set_defaults(func=_serve)
    return root


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
