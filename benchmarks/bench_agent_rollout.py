"""Agent/eval hot paths: batched vs one-at-a-time HF rollout, and corpus entity frequencies.

    .venv/bin/python benchmarks/bench_agent_rollout.py [--repeats 3] [--trajectories 8] [--threads 1]

* **HF rollout**: ``HFGenerator`` rolls out N trajectories in lock-step rounds with one batched
  ``generate`` per round, keeping the KV cache between turns, vs the same without the cache, vs
  the straightforward loop that rolls out one trajectory at a time re-encoding its context.
  Same tiny Qwen3 (the base_model default architecture, tokenizer trained on the embedded corpus),
  greedy decoding, BM25 search in process. Reported: model tokens per second.
* **Entity corpus frequency** (long-tail buckets): one Aho-Corasick pass over the corpus for all
  gold entities (``evaluation.metrics.entity_corpus_frequency``) vs a compiled whole-word regex per
  entity alias over every normalised passage. Results must agree.

Medians over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data/03_primary/corpus.jsonl"
EVAL = ROOT / "data/05_model_input/eval/embedded_validation.jsonl"


def _passages(limit: int | None = None) -> list[dict]:
    if CORPUS.exists():
        rows = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    else:  # no data_prep output: build the embedded passages directly
        from spader_pipeline.data.wiki import iter_passages, load_wiki_articles

        rows = list(iter_passages(load_wiki_articles(limit=3000)))
    return rows[:limit] if limit else rows


def _questions(n: int) -> list[dict]:
    if EVAL.exists():
        rows = [json.loads(line) for line in EVAL.read_text(encoding="utf-8").splitlines()]
        return rows[:n]
    return [
        {"id": str(i), "question": f"Which countries are in region {i}?", "ground_truth": [["x"]]}
        for i in range(n)
    ]


def bench_rollout(repeats: int, n: int, args_threads: int = 1) -> None:
    import torch

    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.rollout import LocalSearch, RolloutConfig, SamplingParams, run_rollouts
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_tiny_qwen3
    from spader_pipeline.modeling.tokenizer import train_tokenizer
    from spader_pipeline.retrieval import build_index, load_retriever
    from spader_pipeline.retrieval.corpus import iter_records

    # One intra-op thread: on the shared 2-core machine two threads oversubscribe and run ~10x slower.
    torch.set_num_threads(args_threads)
    passages = _passages(4000)
    tokenizer = train_tokenizer((p["contents"] for p in passages), vocab_size=8192)
    model = build_tiny_qwen3(tokenizer, TinyQwen3Spec(), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        build_index(iter_records(passages), Path(tmp) / "bm25", "bm25")
        search = LocalSearch(load_retriever(Path(tmp) / "bm25"))
        config = RolloutConfig(max_turns=3, max_response_tokens=2048, topk=3)
        template = "Answer with <tool_call>[...]</tool_call> or <answer>[...]</answer>.\nQuestion: {question}"
        samples = _questions(n)

        def run(batched: bool, reuse_kv_cache: bool = True) -> float:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=48)
            gen = HFGenerator(model, tokenizer, sampling, reuse_kv_cache=reuse_kv_cache)
            start = time.perf_counter()
            if batched:
                asyncio.run(run_rollouts(samples, gen, search, config, template))
            else:
                for sample in samples:
                    asyncio.run(run_rollouts([sample], gen, search, config, template))
            return gen.generated_tokens / (time.perf_counter() - start)

        run(True)  # warm-up
        batched = statistics.median(run(True) for _ in range(repeats))
        no_cache = statistics.median(run(True, reuse_kv_cache=False) for _ in range(repeats))
        single = statistics.median(run(False, reuse_kv_cache=False) for _ in range(repeats))
    print(f"HF rollout, {n} trajectories, greedy, 3 turns x 48 tokens max")
    print(f"  batched, KV cache kept across turns : {batched:8.1f} model tokens/s")
    print(f"  batched, context re-encoded per turn: {no_cache:8.1f} model tokens/s")
    print(f"  one at a time, re-encoded (naive)   : {single:8.1f} model tokens/s")
    print(f"  speed-up vs naive: {batched / single:.2f}x (batching alone {no_cache / single:.2f}x)")


def bench_frequency(repeats: int) -> None:
    from spader_pipeline.algorithms.matching import normalize_answer, normalize_ground_truth
    from spader_pipeline.evaluation.metrics import entity_corpus_frequency

    passages = _passages(4000)
    texts = [f"{p['title']}\n{p['contents']}" for p in passages]
    gts = [q["ground_truth"] for q in _questions(200)]

    def naive() -> list[list[int]]:
        norm = [normalize_answer(t) for t in texts]
        out = []
        for gt in gts:
            row = []
            for aliases in normalize_ground_truth(gt).aliases:
                patterns = [re.compile(rf"(?<!\S){re.escape(a)}(?!\S)") for a in aliases]
                row.append(sum(any(p.search(t) for p in patterns) for t in norm))
            out.append(row)
        return out

    def timed(fn):
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result

    fast = [timed(lambda: entity_corpus_frequency(gts, texts)) for _ in range(repeats)]
    slow = [timed(naive) for _ in range(repeats)]
    assert fast[0][1] == slow[0][1], "implementations disagree"
    f, s = statistics.median(t for t, _ in fast), statistics.median(t for t, _ in slow)
    entities = sum(len(r) for r in fast[0][1])
    print(f"Entity corpus frequency, {entities} entities x {len(texts)} passages")
    print(f"  Aho-Corasick, one pass : {f:7.3f} s")
    print(f"  regex per alias        : {s:7.3f} s")
    print(f"  speed-up               : {s / f:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for generation")
    parser.add_argument("--only", choices=["rollout", "frequency"], default=None)
    args = parser.parse_args()
    if args.only != "rollout":
        bench_frequency(args.repeats)
    if args.only != "frequency":
        bench_rollout(args.repeats, args.trajectories, args.threads)


if __name__ == "__main__":
    main()
