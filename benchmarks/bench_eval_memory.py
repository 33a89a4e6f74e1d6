"""Evaluation under a KV-cache budget: peak memory and throughput against one batch of every question.

    .venv/bin/python benchmarks/bench_eval_memory.py [--env compare] [--questions 100] \
        [--settings none:glibc,6144:4194304] [--smoke]

The straightforward evaluation (``kv_cache_budget_mb: null``) decodes all ``--questions`` greedy
trajectories in one batch, each with its KV cache through all its turns; with a budget the same rows
run in batches whose longest possible caches fit it (:mod:`spader_pipeline.modeling.memory_budget`).
A setting is ``BUDGET_MIB[:MMAP_THRESHOLD[:child]]``: the second part sets glibc's ``MALLOC_MMAP_THRESHOLD_``
for that process (bytes; ``glibc`` = unset, glibc's own sliding threshold), as the Makefile does;
``child`` evaluates in a child process of that process, as the pipelines do (``runner.subprocess``),
so its cost (the child's imports and the records pickled back) is in the wall time.
Each setting runs in its own process (so its peak RSS is its own, from ``getrusage``, the larger of
the process's and its child's) on the warm
start of ``--env`` (``make compare`` builds it) and the first ``--questions`` *training* questions
(no held-out question is scored), with the environment's evaluation settings for trained models.
Prints per setting: wall seconds, questions per second, throughput relative to the first setting,
peak RSS, and whether the records equal the first setting's (the rows per batch are in the log).
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
from pathlib import Path

import smoke

ROOT = Path(__file__).resolve().parents[1]


def one(env: str, questions: int, budget: float | None, out: Path, threads: int, child: bool = False,
        smoke_inputs: bool = False) -> None:
    """Evaluate once (this process) and write ``{seconds, records, peak_rss_kb}`` to ``out``
    (``smoke_inputs``: the environment's settings on the tiny model, index and questions of
    benchmarks/smoke.py instead of its catalog's)."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from measure_warm_start_diversity import _context

    from spader_pipeline.data.formats import samples_from_verl
    from spader_pipeline.evaluation.config import EvaluationConfig
    from spader_pipeline.evaluation.suite import evaluate_models, select_models

    torch.set_num_threads(threads)
    context = _context(env)
    params, catalog = context.params, context.catalog
    settings = dict(params["evaluate"]["trained_models"])
    settings.update((params.get("compare", {}).get("evaluation") or {}).get("trained_models") or {})
    if smoke_inputs:
        model_path, train, index_manifest = str(smoke.model_dir()), smoke.verl_frame(questions), smoke.index_manifest()
    else:
        model_path, train = catalog.load("warm_start_manifest")["path"], catalog.load("verl_train")
        index_manifest = catalog.load("index_manifest")
    entry = {**settings, "name": "warm_start", "path": model_path, "batch_size": questions, "kv_cache_budget_mb": budget}
    if smoke_inputs:  # two short turns
        entry["sampling"] = {**entry["sampling"], "max_new_tokens": 8}
        entry["rollout"] = {**entry["rollout"], "max_turns": 2}
    samples = samples_from_verl(train)[:questions]
    config = EvaluationConfig.from_mapping({
        "models": [entry], "retrieval": {"mode": "service"},
        "runner": {"work_dir": str(out.parent / f"work-{out.stem}"), "progress": False, "resume": False,
                   "subprocess": child},
        "long_tail": {"enabled": False},
    })
    started = time.perf_counter()
    (result,) = evaluate_models(config, select_models(config), {"train": samples}, {},
                                index_manifest=index_manifest, prompt=params["prompt"])
    seconds = time.perf_counter() - started
    records = [{k: v for k, v in r.items() if "second" not in k and "time" not in k} for r in result.records]
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    out.write_text(json.dumps({"seconds": seconds, "records": records, "peak_rss_kb": peak}, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="compare")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--settings", default="none:glibc,6144:4194304",
                        help="BUDGET_MIB[:MMAP_THRESHOLD[:child]] per setting; 'none' = one batch, 'glibc' = unset")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # --smoke: the tiny model of benchmarks/smoke.py on 4 questions, in batches cut to 1 MiB (one setting)
    args = smoke.parse_args(parser, questions=4, settings="1", threads=1)
    if args.one:
        budget = None if args.budget in (None, "none") else float(args.budget)
        one(args.env, args.questions, budget, args.one, args.threads, args.child, args.smoke)
        return

    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for index, setting in enumerate(args.settings.split(",")):
            budget, _, rest = setting.partition(":")
            threshold, _, where = rest.partition(":")
            env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
            if threshold not in ("", "glibc"):
                env["MALLOC_MMAP_THRESHOLD_"] = str(int(threshold))
            out = Path(tmp) / f"setting{index}.json"
            subprocess.run([sys.executable, __file__, "--env", args.env, "--questions", str(args.questions),
                            "--threads", str(args.threads), "--one", str(out), "--budget", budget,
                            *(["--child"] if where == "child" else []), *(["--smoke"] if args.smoke else [])],
                           check=True, cwd=ROOT, env=env)
            result = json.loads(out.read_text())
            first = first or result
            rows.append({
                "kv_cache_budget_mb": budget, "malloc_mmap_threshold": env.get("MALLOC_MMAP_THRESHOLD_", "glibc"),
                "process": "child" if where == "child" else "same",
                "wall_s": round(result["seconds"], 1),
                "questions_per_s": round(args.questions / result["seconds"], 3),
                "throughput_vs_first": round(first["seconds"] / result["seconds"], 3),
                "peak_rss_gb": round(result["peak_rss_kb"] / 2**20, 2),
                # as JSON: records hold NaN, which == never equals once parsed
                "same_records": json.dumps(result["records"]) == json.dumps(first["records"]),
            })
            print(json.dumps(rows[-1]), flush=True)
    print("\n| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
