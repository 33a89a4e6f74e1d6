"""Where a decoding step's time goes on a GPU (docs/gpu.md, "Rollout speed on one GPU").

SmolLM2-135M's shape (30 blocks, 9 heads, 3 KV heads, hidden 576, vocabulary 49,152) with random
weights: a step's cost does not depend on the weights, so this runs on a bare GPU machine with only
torch and transformers. Every row decodes its whole budget (no end-of-sequence token in
``eos_ids``), so each step has all rows active. Timed, per decoding step (median over steps, CUDA
synchronised):

- ``decode_batch``: the rollout's decoder as it runs (logits processors, sampling, the host reading
  each step's tokens to see which rows ended);
- ``forward``: the model's forward over the same growing cache alone, the floor of the loop above;
- ``forward_graph``: that forward in one CUDA graph replay (a static cache as long as the turn), the
  floor without per-kernel launch gaps.

Each at several batch sizes and cached widths, under bf16 autocast (as the trainer decodes) and with
bf16 weights. The table is printed last; ``--profile`` adds torch.profiler's top operations.

    python benchmarks/bench_gpu_decode_step.py --rows 256 512 1024 --widths 1024 3072
    python benchmarks/bench_gpu_decode_step.py --smoke   (2 blocks, 2 rows, on the CPU where there is no GPU)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import smoke
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spader_pipeline.modeling.decode import decode_batch, generation_processors
from spader_pipeline.modeling.kv_cache import GrowingKVCache

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill(model, rows: int, width: int, device: str) -> tuple[GrowingKVCache, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, model.config.vocab_size, (rows, width), device=device)
    mask = torch.ones_like(ids)
    cache = GrowingKVCache()
    model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, ids, mask


def _decode_seconds(model, rows, width, steps, device, autocast) -> float:
    ids = torch.randint(0, model.config.vocab_size, (rows, width), device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=steps, pad_token_id=0)
    processors, do_sample = generation_processors(model, kwargs, ids)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        sync()
        started = time.perf_counter()
        decode_batch(model, ids, mask, GrowingKVCache(), [steps] * rows, eos_ids=set(), pad_id=0,
                     processors=processors, do_sample=do_sample)
        sync()
    return time.perf_counter() - started


@torch.no_grad()
def time_decode_batch(model, rows, width, steps, device, autocast) -> float:
    """Seconds per step of ``decode_batch``: two runs of ``steps`` and ``3 * steps`` steps, the
    difference over ``2 * steps`` (the prefill and the setup cancel)."""
    short = _decode_seconds(model, rows, width, steps, device, autocast)
    long = _decode_seconds(model, rows, width, 3 * steps, device, autocast)
    return (long - short) / (2 * steps)


@torch.no_grad()
def time_forward(model, rows, width, steps, device, autocast) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        cache, ids, mask = prefill(model, rows, width, device)
        token = ids[:, -1:].contiguous()
        full_mask = torch.ones((rows, width + steps), dtype=mask.dtype, device=device)
        times = []
        for step in range(steps):
            sync()
            started = time.perf_counter()
            logits = model(input_ids=token, attention_mask=full_mask[:, : width + step + 1],
                           position_ids=torch.full((rows, 1), width + step, device=device),
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            sync()
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


@torch.no_grad()
def time_forward_graph(model, rows, width, steps, device, autocast) -> float | None:
    """One step of a static-cache decode captured in a CUDA graph (transformers' StaticCache)."""
    from transformers import StaticCache

    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            cache = StaticCache(config=model.config, max_cache_len=width + steps + 8)
            ids = torch.randint(0, model.config.vocab_size, (rows, width), device=device)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                  cache_position=torch.arange(width, device=device))
            token = ids[:, -1:].clone()
            position = torch.tensor([width], device=device)
            static = {"token": token, "position": position}

            def step():
                return model(input_ids=static["token"], past_key_values=cache, use_cache=True, logits_to_keep=1,
                             cache_position=static["position"], position_ids=static["position"][None].expand(rows, 1)).logits

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            times = []
            for k in range(steps):
                static["position"].fill_(width + 3 + k)
                sync()
                started = time.perf_counter()
                graph.replay()
                static["token"].copy_(out[:, -1].argmax(-1, keepdim=True))
                sync()
                times.append(time.perf_counter() - started)
        return statistics.median(times[2:])
    except Exception as err:  # noqa: BLE001 - a transformers without this path: reported, not fatal
        print(f"forward_graph failed at rows={rows} width={width}: {type(err).__name__}: {err}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 3072])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--profile", action="store_true")
    args = smoke.parse_args(parser, rows=[2], widths=[16], steps=3)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (no autocast, no CUDA graph) for --smoke
    shape = {**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 4096} if args.smoke else SMOLLM2_135M
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**shape)).to(device).eval()
    print(torch.__version__, torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
          "attention:", base.config._attn_implementation)
    results = []
    for weights in ("fp32+autocast", "bf16"):
        model = base if weights == "fp32+autocast" else LlamaForCausalLM(LlamaConfig(**shape)).to(
            device, torch.bfloat16).eval()
        autocast = weights == "fp32+autocast"
        time_forward(model, 8, 128, 4, device, autocast)  # warm-up
        for width in args.widths:
            for rows in args.rows:
                row = {"weights": weights, "rows": rows, "width": width,
                       "decode_batch": time_decode_batch(model, rows, width, args.steps, device, autocast),
                       "forward": time_forward(model, rows, width, args.steps, device, autocast),
                       # a static cache as long as the turn, in the weights' dtype (bf16 weights only)
                       "forward_graph": time_forward_graph(model, rows, width, args.steps, device, autocast)
                       if weights == "bf16" else None}
                results.append(row)
                print(row, flush=True)
                gc.collect()
                torch.cuda.empty_cache()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _decode_seconds(base, args.rows[0], args.widths[0], 8, device, True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    print("\nms per decoding step (median); rows decoded per second = rows / step")
    print(f"{'weights':14} {'rows':>5} {'width':>6} {'decode_batch':>13} {'forward':>8} {'graph':>8} {'rows/s':>8}")
    for r in results:
        graph = f"{1e3 * r['forward_graph']:8.1f}" if r["forward_graph"] else "       —"
        print(f"{r['weights']:14} {r['rows']:5d} {r['width']:6d} {1e3 * r['decode_batch']:13.1f} "
              f"{1e3 * r['forward']:8.1f} {graph} {r['rows'] / r['decode_batch']:8.0f}")


if __name__ == "__main__":
    main()
