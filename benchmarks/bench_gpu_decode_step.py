"""A decoding step on a GPU, by path, beside transformers' compiled static-cache ``generate`` and the floor
(docs/gpu.md, "Rollout speed on one GPU"; issue 63).

SmolLM2-135M's shape (30 blocks, 9 heads, 3 KV heads, hidden 576, vocabulary 49,152) with random
weights: a step's cost does not depend on the weights, so this runs on a bare GPU machine with only
torch and transformers. Every row decodes its whole budget (no end-of-sequence token in ``eos_ids``),
so each step has all rows active; ``--width`` prompt tokens, then steps. Per decoding step (CUDA
synchronised; ``decode_batch`` over ``steps`` and ``3 * steps`` steps, the difference over ``2 * steps``, so
the prefill and the setup cancel, after one untimed call that captures the buckets' graphs):

- ``host``: ``decode_batch`` through the model's forward, step by step, the host reading each step's
  tokens (the path before the static step: ``SPADER_STATIC_DECODE=off``);
- ``static``: the static step (modeling/graph_decode.py) launched op by op;
- ``graph``: the static step captured in CUDA graphs (the default on CUDA);
- ``triton`` (in ``--paths``): the graphs with the step's attention as one Triton kernel
  (``SPADER_DECODE_ATTENTION=triton``, modeling/triton_attention.py);
- ``fused`` and ``fused_triton`` (in ``--paths``): the graphs with the work between the step's products as
  four fused Triton kernels a block (``SPADER_DECODE_KERNELS=triton``, modeling/triton_step.py), the attention
  SDPA's or the Triton kernel;
- ``hf_static`` (``--hf-generate``): transformers' ``generate(cache_implementation="static")`` (its forward
  compiled with CUDA graphs), greedy, per step with the prefill subtracted (a run of 1 new token against
  one of ``steps + 1``), and its first call's seconds (the compilation);
- ``q<N>`` (``--length-quanta N ...``): the static step (in graphs where there are any) attending over
  length buckets of ``N`` positions instead of ``static_cache.LENGTH_QUANTUM`` (256): a bucket reads its
  masked tail too (the default's 768 positions where ~560 are real here), and a finer one captures more
  buckets a run;
- ``llamacpp`` (``--llamacpp BINARY``): llama.cpp's ``llama-batched-bench`` (every layer on the GPU) over
  the same random weights, written as a bf16 GGUF (``bench_vs_llamacpp.synthetic_gguf``), ``--width`` prompt
  tokens and ``--llamacpp-steps`` decoding steps a row, its decoding seconds over its steps (median of
  ``--llamacpp-repeats`` runs); it decodes at most 256 sequences at once (``LLAMA_MAX_SEQ``), so at 768 rows
  its 256-sequence step, marked ``*`` (a batch of 768 would take three); ``x llama.cpp``: our best path's
  tokens a second over llama.cpp's;
- ``floor``: the bytes a step must read (the weights once, every row's keys and values) over the
  device's copy bandwidth, measured here (a 2 GiB copy), and the products' FLOPs at the bf16 peak the
  device reaches on a large product, measured too; the larger of the two.

Each under bf16 autocast over fp32 weights (as the trainer decodes) and with bf16 weights. Rows per
second = rows / step. The capture counts and seconds (modeling.graph_decode.static_decode_stats) are
printed last; ``--profile`` adds torch.profiler's top kernels of a step at the last row count, on ``graph``,
``triton``, ``fused``, ``fused_triton`` (where in ``--paths``) and ``static`` (:func:`profile_step`).

    python benchmarks/bench_gpu_decode_step.py --rows 1 8 256 768 --width 512 --hf-generate 256 768 \
        [--llamacpp build/llamacpp/cmake-0.3.36-cuda-sm90/bin/llama-batched-bench]
    python benchmarks/bench_gpu_decode_step.py --smoke   (2 blocks, 2 rows, on the CPU where there is no GPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import smoke
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from spader_pipeline.modeling import graph_decode, static_cache
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.precision import bf16_inference

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
#: path -> (SPADER_STATIC_DECODE, SPADER_CUDA_GRAPHS, SPADER_DECODE_ATTENTION, SPADER_DECODE_KERNELS)
PATHS = {"host": ("off", True, "sdpa", "aten"), "static": ("on", False, "sdpa", "aten"),
         "graph": ("on", True, "sdpa", "aten"), "triton": ("on", True, "triton", "aten"),
         "fused": ("on", True, "sdpa", "triton"), "fused_triton": ("on", True, "triton", "triton")}
#: the paths in CUDA graphs (left out on a CPU)
GRAPH_PATHS = ("graph", "triton", "fused", "fused_triton")


def select(path: str) -> None:
    """The module switches of ``path`` (:data:`PATHS`)."""
    (static_cache.STATIC_DECODE, static_cache.CUDA_GRAPHS, static_cache.DECODE_ATTENTION,
     static_cache.DECODE_KERNELS) = PATHS[path]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _decode_seconds(model, rows: int, width: int, steps: int, autocast: bool) -> float:
    device = model.device
    ids = torch.randint(0, model.config.vocab_size, (rows, width), device=device)
    mask = torch.ones_like(ids)
    with bf16_inference(model, device.type, autocast):
        sync()
        started = time.perf_counter()
        result = decode_batch(model, ids, mask, GrowingKVCache(), [steps] * rows, eos_ids=set(), pad_id=0,
                              processors=LogitsProcessorList(), do_sample=False)
        sync()
    assert result.steps == steps
    return time.perf_counter() - started


@torch.no_grad()
def time_path(model, path: str, rows: int, width: int, steps: int, autocast: bool) -> float:
    """Seconds per step of ``decode_batch`` on ``path`` (:data:`PATHS`): the difference of a ``3 * steps``
    and a ``steps`` call over ``2 * steps``, after an untimed ``3 * steps`` call (its graphs captured)."""
    select(path)
    _decode_seconds(model, rows, width, 3 * steps, autocast)
    short = _decode_seconds(model, rows, width, steps, autocast)
    long = _decode_seconds(model, rows, width, 3 * steps, autocast)
    return (long - short) / (2 * steps)


@torch.no_grad()
def profile_step(model, path: str, rows: int, width: int, steps: int, autocast: bool,
                 top: int = 15) -> list[tuple[str, float, float]]:
    """torch.profiler's view of one decoding step on ``path``: each kernel's (on CUDA; each operator's on a
    CPU) self time and calls in a ``3 * steps`` call less a ``steps`` call, over ``2 * steps``, so the prefill,
    the setup and the captures cancel as in :func:`time_path`. Returns ``(name, ms a step, calls a step)``,
    the ``top`` largest; on ``graph`` the kernels are the replays' (what CUPTI records of them)."""
    from torch.profiler import ProfilerActivity, profile

    select(path)
    _decode_seconds(model, rows, width, 3 * steps, autocast)  # the buckets' graphs captured
    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    totals = []
    for count in (steps, 3 * steps):
        with profile(activities=activities) as prof:
            _decode_seconds(model, rows, width, count, autocast)
        totals.append({event.key: ((getattr(event, "self_device_time_total", None) or getattr(
            event, "self_cuda_time_total", 0)) if cuda else event.self_cpu_time_total, event.count)
            for event in prof.key_averages()})
    short, long = totals
    per_step = [(name, (micros - short.get(name, (0, 0))[0]) / (2 * steps) / 1e3,
                 (calls - short.get(name, (0, 0))[1]) / (2 * steps)) for name, (micros, calls) in long.items()]
    return sorted(per_step, key=lambda entry: -entry[1])[:top]


def time_quantum(model, quantum: int, rows: int, width: int, steps: int, autocast: bool) -> float:
    """:func:`time_path` of the static step (``graph`` on CUDA, else ``static``) with length buckets of
    ``quantum`` positions."""
    default, static_cache.LENGTH_QUANTUM = static_cache.LENGTH_QUANTUM, quantum
    try:
        return time_path(model, "graph" if torch.cuda.is_available() else "static", rows, width, steps, autocast)
    finally:
        static_cache.LENGTH_QUANTUM = default


@torch.no_grad()
def time_hf_static(model, rows: int, width: int, steps: int) -> tuple[float, float] | None:
    """transformers' ``generate(cache_implementation="static")``, greedy: (seconds per step, seconds of the
    first call). Its per-step time is a ``steps + 1``-token call less a 1-token call (the prefill and the
    setup cancel), each the median of 3 after the first."""
    ids = torch.randint(0, model.config.vocab_size, (rows, width), device=model.device)
    mask = torch.ones_like(ids)

    def run(new: int) -> float:
        sync()
        started = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
        sync()
        return time.perf_counter() - started

    try:
        first = run(steps + 1)
        long = statistics.median(run(steps + 1) for _ in range(3))
        short = statistics.median(run(1) for _ in range(3))
    except Exception as err:  # noqa: BLE001 - a transformers without this path: reported, not fatal
        print(f"hf_static failed at rows={rows}: {type(err).__name__}: {err}", flush=True)
        return None
    return (long - short) / steps, first


def device_rates(device: str) -> tuple[float, float]:
    """(bytes per second of a 2 GiB device copy, read and write; bf16 FLOP/s of a 8192² product)."""
    if device != "cuda":
        return 50e9, 1e12  # the CPU's smoke run: nominal
    source = torch.empty(2**30, dtype=torch.bfloat16, device=device)  # 2 GiB
    target = torch.empty_like(source)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    copies, products = [], []
    for _ in range(5):
        sync()
        started = time.perf_counter()
        target.copy_(source)
        sync()
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        a @ a
        sync()
        products.append(time.perf_counter() - started)
    del source, target, a
    torch.cuda.empty_cache()
    return 2 * 2**31 / min(copies), 2 * 8192**3 / min(products)


def floor_seconds(config: dict, rows: int, positions: int, bandwidth: float, flops: float) -> float:
    """The larger of a step's reads (the linear weights in bf16 once, every row's bf16 keys and values over
    ``positions``) over ``bandwidth``, and its products' FLOPs (2 per weight per row) over ``flops``."""
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * dim
    weights = layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inner) + hidden * config["vocab_size"]
    cache = layers * 2 * kv * positions * rows
    return max(2 * (weights + cache) / bandwidth, 2 * weights * rows / flops)


def time_llamacpp(model, binary: Path, results: list[dict], width: int, steps: int, repeats: int) -> None:
    """llama.cpp's decoding step (seconds) at each row count of ``results`` (the rows of ``model``'s
    weights), over ``model``'s weights as a bf16 GGUF: into each row as ``llamacpp`` (and
    ``llamacpp_sequences`` where capped); a failure is said and leaves the column empty."""
    import tempfile

    import bench_vs_llamacpp

    rows = sorted({r["rows"] for r in results if r["weights"] == "fp32+autocast"})
    if not rows:
        print("llama.cpp: timed beside the fp32 + autocast rows (--weights has none)", flush=True)
        return
    cuda = torch.cuda.is_available()
    try:
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            gguf = bench_vs_llamacpp.synthetic_gguf(model, Path(folder) / "model.bf16.gguf")
            print(f"llama.cpp: {binary}, the model as {gguf.stat().st_size / 2**20:.0f} MiB of bf16 GGUF "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
            runs = []
            for _ in range(repeats):
                run = bench_vs_llamacpp.run_batched_bench(binary, gguf, rows, os.cpu_count() or 1, width, steps,
                                                          cuda=cuda)
                steps_ms = ", ".join(f"{n}: {r['step_ms']:.2f}" for n, r in run["rows"].items())
                print(f"  llama.cpp ms a step: {steps_ms}; {run['settings']}", flush=True)
                runs.append(run)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - llama.cpp's failure leaves our figures standing
        print(f"llama.cpp failed: {type(error).__name__}: {error}"[:2000], flush=True)
        return
    for r in results:
        if r["weights"] == "fp32+autocast":
            r["llamacpp"] = statistics.median(run["rows"][r["rows"]]["step_ms"] for run in runs) / 1e3
            r["llamacpp_sequences"] = runs[0]["rows"][r["rows"]].get("sequences")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256, 768])
    parser.add_argument("--width", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--paths", default="host,static,graph", help="of " + ", ".join(PATHS) + " (comma-separated)")
    parser.add_argument("--bf16-paths", default=None, help="the paths with bf16 weights (default: --paths)")
    parser.add_argument("--weights", default="fp32+autocast,bf16", help="of fp32+autocast, bf16 (comma-separated)")
    parser.add_argument("--hf-generate", type=int, nargs="*", default=[],
                        help="rows at which to time transformers' static-cache generate too (compiles: ~40 s each)")
    parser.add_argument("--length-quanta", type=int, nargs="*", default=[],
                        help="also time the static step attending over length buckets of these many positions")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--llamacpp", default=None, help="a llama-batched-bench to time at the same shape and weights")
    parser.add_argument("--llamacpp-steps", type=int, default=64, help="its decoding steps a row")
    parser.add_argument("--llamacpp-repeats", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=8,
                        help="--profile's window: a 3x call less a 1x call of this many steps (each kernel an event)")
    args = smoke.parse_args(parser, rows=[2], width=16, steps=3, length_quanta=[8])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU for --smoke: no graphs there
    shape = {**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 4096} if args.smoke else SMOLLM2_135M
    on_device = {name.split(",")[0]: [p for p in name.split(",")[1:] if device == "cuda" or p not in GRAPH_PATHS]
                 for name in (f"fp32+autocast,{args.paths}", f"bf16,{args.bf16_paths or args.paths}")}
    torch.manual_seed(0)
    fp32 = LlamaForCausalLM(LlamaConfig(**shape)).to(device).eval().requires_grad_(False)
    use_gqa_attention(fp32)  # as load_model_and_tokenizer sets it: the host loop's attention reads the heads in place
    print(torch.__version__, torch.cuda.get_device_name(0) if device == "cuda" else "cpu", flush=True)
    bandwidth, flops = device_rates(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 product {flops / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    for weights in args.weights.split(","):
        model = fp32 if weights == "fp32+autocast" else LlamaForCausalLM(LlamaConfig(**shape)).to(
            device, torch.bfloat16).eval().requires_grad_(False)
        use_gqa_attention(model)
        autocast = weights == "fp32+autocast"
        for rows in args.rows:
            row = {"weights": weights, "rows": rows, "width": args.width, "steps": args.steps,
                   "floor": floor_seconds(shape, rows, args.width + 2 * args.steps, bandwidth, flops)}
            for path in on_device[weights]:
                try:
                    row[path] = time_path(model, path, rows, args.width, args.steps, autocast)
                except Exception as error:  # noqa: BLE001 - a path that fails (a new kernel) is said; the others run
                    print(f"{path} at {rows} rows failed: {type(error).__name__}: {error}"[:300], flush=True)
                    row[path] = None
            for quantum in args.length_quanta:
                row[f"q{quantum}"] = time_quantum(model, quantum, rows, args.width, args.steps, autocast)
            if weights == "bf16" and rows in args.hf_generate:
                timed = time_hf_static(model, rows, args.width, args.steps)
                row["hf_static"], row["hf_static_first_s"] = timed if timed else (None, None)
            results.append(row)
            print(row, flush=True)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    if args.llamacpp:
        time_llamacpp(fp32, Path(args.llamacpp), results, args.width, args.llamacpp_steps, args.llamacpp_repeats)
    if args.profile:
        profiled = ["graph", *(p for p in GRAPH_PATHS[1:] if p in args.paths.split(",")), "static"]
        for path in profiled if device == "cuda" else ("static",):
            try:
                entries = profile_step(fp32, path, args.rows[-1], args.width, args.profile_steps, True)
            except Exception as error:  # noqa: BLE001 - as above
                print(f"the profile of {path} failed: {type(error).__name__}: {error}"[:300], flush=True)
                continue
            print(f"\n{path}, {args.rows[-1]} rows, fp32 + autocast: the top {'kernels' if device == 'cuda' else 'operators'} "
                  f"of a decoding step (self time, {3 * args.profile_steps} steps less {args.profile_steps})")
            print(f"{'ms a step':>10} {'calls':>7}  name")
            for name, millis, calls in entries:
                print(f"{millis:10.3f} {calls:7.1f}  {name[:110]}")
    stats = graph_decode.static_decode_stats()
    print(f"\nms per decoding step; tokens/s = rows / step. Graphs captured: {stats['captures']} in "
          f"{stats['capture_seconds']:.1f} s (each bucket's first step included); static caches allocated: "
          f"{stats['allocations']}; replays {stats['replays']}")
    ours = [*PATHS, *(f"q{quantum}" for quantum in args.length_quanta)]
    columns = [*ours, "hf_static", "llamacpp", "floor"]
    print(f"{'weights':14} {'rows':>5} " + " ".join(f"{c:>{max(10, len(c))}}" for c in columns) + f" {'best tok/s':>11}"
          + (f" {'x llama.cpp':>11}" if args.llamacpp else ""))
    for r in results:
        cells = [(f"{1e3 * r[c]:{max(10, len(c)) - 1}.2f}" + ("*" if c == "llamacpp" and r.get("llamacpp_sequences")
                                                              else " ")) if r.get(c) else f"{'-':>{max(10, len(c))}}"
                 for c in columns]
        best = min((r[p] for p in ours if r.get(p)), default=None)  # none: the CPU, where there are no graphs
        rate = f"{r['rows'] / best:11.0f}" if best else f"{'-':>11}"
        # tokens a second, ours over llama.cpp's (at its most sequences where capped: what it would sustain)
        theirs = (r.get("llamacpp_sequences") or r["rows"]) / r["llamacpp"] if r.get("llamacpp") else None
        ratio = f" {r['rows'] / best / theirs:11.2f}" if best and theirs else ""
        print(f"{r['weights']:14} {r['rows']:5d} " + " ".join(cells) + f" {rate}{ratio}")
    if any(r.get("llamacpp_sequences") for r in results):
        print("* llama.cpp's step at its most sequences at once (LLAMA_MAX_SEQ), not at the row count; "
              "x llama.cpp compares tokens a second")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                                               "torch": torch.__version__, "bandwidth": bandwidth, "flops": flops,
                                               "stats": stats, "rows": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
