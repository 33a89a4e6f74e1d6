"""Decoding under bf16 autocast when RL freezes the bottom blocks (docs/performance.md).

Autocast keeps its bf16 copy of a weight for the rest of the context only when the weight requires
grad. The native trainer trains SmolLM2's top 8 of 30 blocks, so the straightforward decode
(``torch.autocast`` around a turn) casts the 22 frozen blocks' weights again at every decoding step;
:func:`~spader_pipeline.modeling.precision.bf16_inference` casts each once per turn. Both decode the
same tokens (the same bits: checked here); this times a turn of ``--steps`` greedy tokens after a
``--width``-token prefill, per batch size, as the median of ``--repeats`` interleaved runs.

SmolLM2-135M's shape with random weights (a step's cost does not depend on them); CPU, with the
threads torch has (``OMP_NUM_THREADS``). Autocast runs on a CPU without bf16 units too, only slowly.

    python benchmarks/bench_frozen_weight_casts.py --rows 1 16 --steps 32 --repeats 5
    python benchmarks/bench_frozen_weight_casts.py --smoke   (4 blocks, top 2 trained, one row)
"""

from __future__ import annotations

import argparse
import statistics
import time

import smoke
import torch
from bench_gpu_decode_step import SMOLLM2_135M
from transformers import LlamaConfig, LlamaForCausalLM

from spader_pipeline.modeling.decode import decode_batch, generation_processors
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.precision import bf16_inference

TRAINED_BLOCKS = 8  # conf/base training.native.trainable_layers


def frozen_bottom_model(shape: dict = SMOLLM2_135M, trained: int = TRAINED_BLOCKS) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    model.requires_grad_(False)
    for block in model.model.layers[-trained:]:
        block.requires_grad_(True)
    model.model.norm.requires_grad_(True)
    return model


def decode_turn(model, ids: torch.Tensor, steps: int, cached: bool) -> tuple[float, list[list[int]]]:
    """Seconds of one greedy turn of ``steps`` tokens per row, and the tokens."""
    kwargs = dict(do_sample=False, max_new_tokens=steps, pad_token_id=0)
    processors, do_sample = generation_processors(model, kwargs, ids)
    context = bf16_inference(model, "cpu", enabled=True) if cached else torch.autocast("cpu", dtype=torch.bfloat16)
    started = time.perf_counter()
    with context:
        result = decode_batch(model, ids, torch.ones_like(ids), GrowingKVCache(), [steps] * len(ids), eos_ids=set(),
                              pad_id=0, processors=processors, do_sample=do_sample)
    return time.perf_counter() - started, result.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--width", type=int, default=256, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=32, help="decoded tokens per row")
    parser.add_argument("--repeats", type=int, default=5)
    args = smoke.parse_args(parser, rows=[1], width=8, steps=2, repeats=1)
    model = frozen_bottom_model({**SMOLLM2_135M, "num_hidden_layers": 4, "vocab_size": 4096}, 2) if args.smoke \
        else frozen_bottom_model()
    print(f"threads {torch.get_num_threads()}; {args.width}-token prompt, {args.steps} greedy tokens per row; "
          f"median of {args.repeats} (ms per token: the turn, its prefill included, over its tokens)")
    print("| rows | autocast around the turn (frozen weights cast every step) | `bf16_inference` | ratio |")
    print("|---|---|---|---|")
    for rows in args.rows:
        ids = torch.randint(1, model.config.vocab_size, (rows, args.width), generator=torch.Generator().manual_seed(rows))
        decode_turn(model, ids, 2, cached=True)  # warm-up: kernels and allocator
        times: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {}
        for _ in range(args.repeats):
            for cached in (False, True):  # interleaved, so drifts in the machine's speed hit both
                seconds, tokens[cached] = decode_turn(model, ids, args.steps, cached)
                times[cached].append(seconds)
        if tokens[False] != tokens[True]:
            raise SystemExit(f"rows {rows}: the two decodes differ")
        plain, cached = (1e3 * statistics.median(times[c]) / args.steps for c in (False, True))
        print(f"| {rows} | {plain:.1f} | {cached:.1f} | {plain / cached:.2f}× |")


if __name__ == "__main__":
    main()
