"""Agent/eval hot paths: batched vs one-at-a-time HF rollout, and corpus entity frequencies.

    .venv/bin/python benchmarks/bench_agent_rollout.py [--repeats 3] [--trajectories 8] [--threads 1]
        [--model-dir data/06_models/warm_start] [--smoke]

* **HF rollout**: ``HFGenerator`` rolls out N trajectories in lock-step rounds with one batched
  decoding call per round, keeping the KV cache between turns in a ``GrowingKVCache`` (decoding
  writes in place) and decoding with ``modeling.decode.decode_batch`` (a row leaves the batch when
  its turn ends) and prefilling each turn's new tokens in blocks of rows of similar length, vs the
  same with the prefill as one forward padded to the longest row (``one_prefill``), vs the same with
  ``model.generate`` (finished rows decode padding until the
  longest row ends), vs transformers' ``DynamicCache`` (a copy of the cache per token, decoded by
  ``generate``), vs re-encoding the context every turn, vs the straightforward loop that rolls out
  one trajectory at a time re-encoding its context. Greedy decoding, BM25 search in process.
  Default model: a tiny Qwen3 (tokenizer trained on the embedded corpus). ``--model-dir``: a real
  HF folder (e.g. the SmolLM2 warm start) on the embedded_test questions with the project's prompt
  template and rollout limits, as evaluation runs it (the one-at-a-time loop is skipped there: it
  takes minutes). Reported: model tokens per second, the share of sampled row-steps that were
  padding (rows whose turn had ended), and the share of the machine's fp32 matmul peak the rollout
  reaches (peak: ``torch.mm`` of 2048x2048 fp32 matrices on the same threads; rollout FLOPs: 2 x the
  parameters of the model's linear layers per generated token — prefill and attention not counted,
  so a lower bound).
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

import smoke

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # --data-root: e.g. data/compare for the multi-search task of `make compare`
PASSAGES, QUESTIONS = 4000, 200  # the tiny model's corpus and the frequency benchmark's size (--smoke: fewer)


def _passages(limit: int | None = None) -> list[dict]:
    corpus = DATA / "03_primary/corpus.jsonl"
    if corpus.exists():
        rows = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    else:  # no data_prep output: build the embedded passages directly
        from spader_pipeline.data.wiki import iter_passages, load_wiki_articles

        rows = list(iter_passages(load_wiki_articles(limit=3000)))
    return rows[:limit] if limit else rows


def _questions(n: int) -> list[dict]:
    validation = DATA / "05_model_input/eval/embedded_validation.jsonl"
    if validation.exists():
        rows = [json.loads(line) for line in validation.read_text(encoding="utf-8").splitlines()]
        return rows[:n]
    return [
        {"id": str(i), "question": f"Which countries are in region {i}?", "ground_truth": [["x"]]}
        for i in range(n)
    ]


def _project_setup(model_dir: str, n: int, max_turns: int | None = None):
    """(model, tokenizer, questions, template, rollout config) as evaluation uses them."""
    import yaml

    from spader_pipeline.agent.prompts import resolve_template
    from spader_pipeline.agent.types import RolloutConfig
    from spader_pipeline.modeling import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir)
    test = DATA / "05_model_input/eval/embedded_test.jsonl"
    if not test.is_file():
        raise SystemExit(f"{test} not found: run `make run` (or `kedro run --pipeline data_prep`) first")
    rows = [json.loads(line) for line in test.read_text(encoding="utf-8").splitlines()][:n]
    prompt = yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"]
    training = yaml.safe_load((ROOT / "conf/base/parameters_training.yml").read_text())["training"]
    template = resolve_template(prompt)
    rollout = {**training["rollout"], **({"max_turns": max_turns} if max_turns else {})}
    return model, tokenizer, rows, template, RolloutConfig.from_mapping(rollout)


VARIANTS = ("growing", "one_prefill", "generate", "dynamic", "no_cache", "single")


def matmul_peak_flops(size: int = 2048, repeats: int = 10, dtype=None) -> float:
    """FLOP/s of ``torch.mm`` on ``size x size`` matrices of ``dtype`` (default fp32), best of
    ``repeats`` (current threads)."""
    import torch

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def linear_params(model) -> int:
    """Weights of the model's linear layers (output layer included): the multiply-adds of one token."""
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def bench_rollout(repeats: int, n: int, args_threads: int = 1, model_dir: str | None = None,
                  variants: tuple[str, ...] = VARIANTS, max_turns: int | None = None, max_new_tokens: int = 48) -> None:
    import torch

    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.rollout import run_rollouts
    from spader_pipeline.agent.types import RolloutConfig, SamplingParams
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_tiny_qwen3
    from spader_pipeline.modeling.tokenizer import train_tokenizer
    from spader_pipeline.retrieval import build_index, load_retriever
    from spader_pipeline.retrieval.corpus import iter_records
    from spader_pipeline.retrieval.service import LocalSearch

    # One intra-op thread: on the shared 2-core machine two threads oversubscribe and run ~10x slower.
    torch.set_num_threads(args_threads)
    passages = _passages(PASSAGES if model_dir is None else None)
    if model_dir is None:
        tokenizer = train_tokenizer((p["contents"] for p in passages), vocab_size=8192)
        model = build_tiny_qwen3(tokenizer, TinyQwen3Spec(), seed=0)
        config = RolloutConfig(max_turns=3, max_response_tokens=2048, topk=3)
        template = "Answer with <tool_call>[...]</tool_call> or <answer>[...]</answer>.\nQuestion: {question}"
        samples = _questions(n)
    else:
        model, tokenizer, samples, template, config = _project_setup(model_dir, n, max_turns)
    with tempfile.TemporaryDirectory() as tmp:
        build_index(iter_records(passages), Path(tmp) / "bm25", "bm25")
        search = LocalSearch(load_retriever(Path(tmp) / "bm25"))

        def run(batched: bool, reuse_kv_cache: bool = True, growing: bool = True,
                drop: bool = True, blocks: bool = True) -> tuple[float, float]:
            """(model tokens/s, share of sampled row-steps that were padding)."""
            sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
            options = {} if drop else {"drop_finished_rows": False}  # only what differs from the defaults:
            if not blocks:  # the same script then also times older code (PYTHONPATH=<old checkout>/src)
                options["prefill_block_cost"] = None
            gen = HFGenerator(model, tokenizer, sampling, reuse_kv_cache=reuse_kv_cache, growing_kv_cache=growing,
                              micro_batch_size=max(32, len(samples)), **options)
            start = time.perf_counter()
            if batched:
                asyncio.run(run_rollouts(samples, gen, search, config, template))
            else:
                for sample in samples:
                    asyncio.run(run_rollouts([sample], gen, search, config, template))
            seconds = time.perf_counter() - start
            sampled = getattr(gen, "sampled_rows", 0)  # older checkouts do not count it
            return gen.generated_tokens / seconds, 1 - gen.generated_tokens / sampled if sampled else float("nan")

        run(True)  # warm-up
        # Alternate the variants within each repeat so a change in machine load hits all alike.
        runs = {
            "growing": lambda: run(True),
            "one_prefill": lambda: run(True, blocks=False),
            "generate": lambda: run(True, drop=False),
            "dynamic": lambda: run(True, growing=False),
            "no_cache": lambda: run(True, reuse_kv_cache=False),
            "single": lambda: run(False, reuse_kv_cache=False),
        }
        times: dict[str, list[float]] = {k: [] for k in variants if k != "single" or model_dir is None}
        padded: dict[str, float] = {}
        for _ in range(repeats):
            for name in times:
                rate, padded[name] = runs[name]()
                times[name].append(rate)
        med = {k: statistics.median(v) for k, v in times.items()}
    peak = matmul_peak_flops()
    flops_per_token = 2 * linear_params(model)
    print(f"HF rollout, {len(samples)} trajectories, greedy, {config.max_turns} turns x {max_new_tokens} tokens max, "
          f"{model_dir or 'tiny Qwen3'}, {args_threads} thread(s), median of {repeats}")
    labels = {
        "growing": "batched, GrowingKVCache, drop finished",
        "one_prefill": "the same, prefill as one padded forward",
        "generate": "batched, GrowingKVCache, generate       ",
        "dynamic": "batched, DynamicCache, generate         ",
        "no_cache": "batched, context re-encoded per turn     ",
        "single": "one at a time, re-encoded (naive)        ",
    }
    print(f"  matmul peak (torch.mm 2048^2 fp32): {peak / 1e9:.1f} GFLOP/s; "
          f"{flops_per_token / 1e6:.1f} MFLOP per generated token (2 x linear weights)")
    for name, value in med.items():
        print(f"  {labels[name]:40s}: {value:8.1f} model tokens/s, {100 * padded[name]:4.1f}% padded row-steps, "
              f"{100 * value * flops_per_token / peak:5.1f}% of matmul peak  "
              f"(runs: {', '.join(f'{t:.1f}' for t in times[name])})")
    if "growing" in med and "generate" in med:
        print(f"  drop finished rows vs generate: {med['growing'] / med['generate']:.2f}x")
    if "growing" in med and "one_prefill" in med:
        print(f"  prefill in blocks of rows vs one padded forward: {med['growing'] / med['one_prefill']:.2f}x")
    for name in ("dynamic", "no_cache", "single"):
        if "growing" in med and name in med:
            print(f"  GrowingKVCache (drop finished) vs {name}: {med['growing'] / med[name]:.2f}x")


def bench_frequency(repeats: int) -> None:
    from spader_pipeline.algorithms.matching import normalize_answer, normalize_ground_truth
    from spader_pipeline.evaluation.metrics import entity_corpus_frequency

    passages = _passages(PASSAGES)
    texts = [f"{p['title']}\n{p['contents']}" for p in passages]
    gts = [q["ground_truth"] for q in _questions(QUESTIONS)]

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
    parser.add_argument("--model-dir", default=None, help="a real HF model folder (default: tiny Qwen3)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--data-root", default="data", help="the Kedro env's data root (data/compare: make compare's task)")
    parser.add_argument("--max-turns", type=int, default=None, help="rollout turns (default: training.rollout)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per turn")
    args = smoke.parse_args(parser, repeats=1, trajectories=2, max_new_tokens=8)
    global DATA, PASSAGES, QUESTIONS
    DATA = ROOT / args.data_root
    if args.smoke:
        PASSAGES, QUESTIONS = 300, 20
    if args.only != "rollout":
        bench_frequency(args.repeats)
    if args.only != "frequency":
        bench_rollout(args.repeats, args.trajectories, args.threads, args.model_dir,
                      tuple(v for v in args.variants.split(",") if v), args.max_turns, args.max_new_tokens)


if __name__ == "__main__":
    main()
