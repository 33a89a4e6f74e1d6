"""A continued turn's prefill in blocks of rows: the GPU's block cost against the CPU's and one padded forward.

Each turn of a rollout after the first feeds every row its new tokens (the last sampled token and the
search's observation) on top of its cached context. :func:`~spader_pipeline.modeling.decode.decode_batch`
runs that prefill in blocks of rows of similar length when :func:`~spader_pipeline.modeling.batching.
padding_blocks` models it cheaper than padding every row to the longest: a block costs its padded token
positions plus a fixed ``overhead_tokens`` a forward. On a CPU a forward's fixed cost is small
(``PREFILL_BLOCK_COST``, 32 tokens); on a GPU a forward's cost is that of ~240,000 positions (fitted to
this benchmark on an H200: ``GPU_PREFILL_BLOCK_COST``), so the CPU's cost cuts a wide batch into dozens of
forwards there and the GPU's keeps it whole.
This times the three on the same turn: the CPU's cost, the GPU's, and one padded forward (the
straightforward way), with the forwards each ran and the token positions they computed.

SmolLM2-135M's shape with random weights under bf16 autocast, ``--rows`` rows with a ``--context``-token
first turn cached, then ``--new-min``..``--new-max`` new tokens a row (uniform: observations vary in
length), one token sampled (greedy), so the call is its prefill. Median of ``--repeats``; each call starts
from the same cached first turn (rebuilt, untimed).

    python benchmarks/bench_prefill_blocks.py [--rows 768] [--context 512] [--device cuda] [--smoke]
"""

from __future__ import annotations

import argparse
import random

import smoke
import torch
from bench_gpu_decode_step import SMOLLM2_135M
from timing import interleaved_medians
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from spader_pipeline.modeling.batching import padding_blocks
from spader_pipeline.modeling.decode import GPU_PREFILL_BLOCK_COST, PREFILL_BLOCK_COST, decode_batch
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.precision import bf16_inference

WAYS = {"the CPU's cost": PREFILL_BLOCK_COST, "the GPU's cost": GPU_PREFILL_BLOCK_COST, "one padded forward": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=768)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-min", type=int, default=60)
    parser.add_argument("--new-max", type=int, default=420)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = smoke.parse_args(parser, rows=8, context=16, new_min=2, new_max=12, repeats=1)
    shape = {**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 4096} if args.smoke else SMOLLM2_135M
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(args.device).eval().requires_grad_(False)
    device, vocab = torch.device(args.device), shape["vocab_size"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = random.Random(0)
    new = [rng.randint(args.new_min, args.new_max) for _ in range(args.rows)]
    block = torch.zeros((args.rows, max(new)), dtype=torch.long)
    block_mask = torch.zeros_like(block)
    for row, count in enumerate(new):  # left-padded, as a continued turn's new tokens
        block[row, -count:] = torch.randint(3, vocab, (count,))
        block_mask[row, -count:] = 1
    first = torch.randint(3, vocab, (args.rows, args.context))
    call = dict(eos_ids=set(), pad_id=0, processors=LogitsProcessorList(), do_sample=False)

    def first_turn():
        """A cache holding every row's first turn, rows in input order, and the continued turn's inputs."""
        cache = GrowingKVCache()
        with torch.no_grad(), bf16_inference(model, device.type, True):
            result = decode_batch(model, first.to(device), torch.ones_like(first, device=device), cache,
                                  [1] * args.rows, **call)
        where = {row: k for k, row in enumerate(result.cache_rows)}
        cache.batch_select_indices(torch.tensor([where[row] for row in range(args.rows)], device=device))
        ids = torch.cat([result.ids.cpu(), block], dim=1).to(device)
        mask = torch.cat([result.mask.cpu(), block_mask], dim=1).to(device)
        return cache, ids, mask

    def continued(cost):
        def turn(prepared):
            cache, ids, mask = prepared
            with torch.no_grad(), bf16_inference(model, device.type, True):
                return decode_batch(model, ids, mask, cache, [1] * args.rows, prefill_block_cost=cost, **call)
        return turn

    medians, results = interleaved_medians({name: continued(cost) for name, cost in WAYS.items()}, args.repeats,
                                           sync, prepare=first_turn)
    tokens = {name: result.tokens for name, result in results.items()}
    print(f"a continued turn's prefill: {args.rows} rows, {args.context} cached, {args.new_min}-{args.new_max} new "
          f"tokens a row ({sum(new)} in all), {device.type}, median of {args.repeats}")
    print(f"  {'way':20s} {'forwards':>8s} {'positions':>10s} {'ms':>9s} {'tokens as one forward':>22s}")
    by_length = sorted(new, reverse=True)
    for name, cost in WAYS.items():
        blocks = padding_blocks(by_length, min_tokens=cost[0], overhead_tokens=cost[1]) if cost else [range(args.rows)]
        positions = sum(len(b) * by_length[b.start] for b in blocks)
        same = sum(a == b for a, b in zip(tokens[name], tokens["one padded forward"], strict=True)) / args.rows
        print(f"  {name:20s} {results[name].prefill_blocks:8d} {positions:10d} {medians[name] * 1e3:9.1f} {same:21.0%}")
    cpu, gpu, one = medians.values()
    print(f"  the GPU's cost over the CPU's: {cpu / gpu:.2f}x; one padded forward over the GPU's cost: {one / gpu:.2f}x")

if __name__ == "__main__":
    main()
