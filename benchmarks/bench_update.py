"""The native RL update of one step, its passes encoding the shared instruction once against one pass
over whole rows: seconds, and the operations the host launches.

The one-GPU run's update (``conf/one_gpu``): 48 prompts × 16 trajectories, 3 optimiser steps of 16
groups each (``ppo_mini_batches``), micro-batches of at most 64 rows and 65,536 padded tokens, the top
8 of SmolLM2's 30 blocks trained from the rollout's boundary states on the device, bf16 autocast on
CUDA. On the H200 that update took 6-7 s beside the other method's rollout (docs/records/one_gpu),
where its arithmetic is well under a second. Every row starts with the same ~144-token instruction;
with ``shared_prefix`` each pass runs it once and the rows continue from its keys and values, which
runs every trained block twice (the prefix, then the rest): about twice the operations of one pass
over whole rows, for ~16% less arithmetic. Which is faster is the device's to say: this runs
:func:`~spader_pipeline.native.update.update_policy` itself both ways on the same batch.

Trajectories shaped as the run's (a 144-token instruction and a question, ~735 response tokens of
which ~170 the model's in 5 turns), random weights and boundary states (the time does not depend on
the values), a tiny learning rate. Per way: the median seconds of an update (interleaved repeats),
padded tokens a second, and, from one more update under a ``TorchDispatchMode``, the operations it
dispatched (views not counted) and, off the CPU, the host's waits for the device among them.
``--profile`` adds torch.profiler's top operations of one update per way (device time on CUDA).

    python benchmarks/bench_update.py [--prompts 48] [--repeats 3] [--device cuda] [--profile] [--smoke]
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import smoke
import torch
from bench_gpu_decode_step import SMOLLM2_135M
from dispatch import DispatchCount
from timing import interleaved_medians
from transformers import LlamaConfig, LlamaForCausalLM

from spader_pipeline.modeling import train_top_layers
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.native.batch import Advantages, RolloutBatch
from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.native.update import actor_config, update_policy

WAYS = {"shared prefix": True, "one pass": False}
def rollout_batch(prompts: int, group: int, *, vocab: int, hidden: int, first_block: int, instruction: int,
                  response: tuple[int, int], turns: int, model_tokens: int, device: torch.device,
                  seed: int = 0) -> tuple[RolloutBatch, Advantages]:
    """Right-padded trajectories as the native rollout lays them out, boundary states on ``device``."""
    rng = random.Random(seed)
    rows = prompts * group
    shared = [rng.randrange(3, vocab) for _ in range(instruction)]
    questions = [shared + [rng.randrange(3, vocab) for _ in range(rng.randint(20, 40))] for _ in range(prompts)]
    prompt_lengths = [len(questions[row // group]) for row in range(rows)]
    response_lengths = [rng.randint(*response) for _ in range(rows)]
    width = max(p + r for p, r in zip(prompt_lengths, response_lengths, strict=True))
    width_r = max(response_lengths)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    response_mask = torch.zeros(rows, width_r)
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        input_ids[row, :p] = torch.tensor(questions[row // group])
        input_ids[row, p : p + r] = torch.randint(3, vocab, (r,))
        attention[row, : p + r] = 1
        per_turn = model_tokens // turns
        for start in range(0, r, max(r // turns, 1)):  # each turn: the model's tokens, then an observation
            response_mask[row, start : min(start + per_turn, r)] = 1
    response_ids = torch.zeros(rows, width_r, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        response_ids[row, :r] = input_ids[row, p : p + r]
    generator = torch.Generator().manual_seed(seed)
    boundary = torch.randn(rows, width, hidden, device=device) * attention.to(device)[..., None]  # made there
    zeros = torch.zeros(rows)
    batch = RolloutBatch(
        input_ids=input_ids, attention_mask=attention, prompt_lengths=torch.tensor(prompt_lengths),
        response_ids=response_ids, response_mask=response_mask, uids=np.repeat(np.arange(prompts), group),
        ground_truths=[[] for _ in range(rows)], rewards=None, precision=zeros, recall=zeros, num_turns=zeros,
        num_searches=zeros, boundary=boundary, boundary_block=first_block)
    advantages = torch.randn(rows, width_r, generator=generator) * response_mask
    return batch, Advantages(token_rewards=torch.zeros_like(advantages), returns=zeros, advantages=advantages,
                             discovery=zeros, cost_coefficient=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--mini-batches", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=65536)
    parser.add_argument("--trainable-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's top operations of one update per way")
    args = smoke.parse_args(parser, prompts=3, group=2, micro_batch=2, trainable_layers=1, repeats=1)
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
            "num_hidden_layers": 2, "vocab_size": 512}
    shape = {**SMOLLM2_135M, **tiny} if args.smoke else SMOLLM2_135M
    sizes = (dict(instruction=16, response=(20, 60), turns=2, model_tokens=10) if args.smoke
             else dict(instruction=144, response=(600, 870), turns=5, model_tokens=170))
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device).train()
    trainable = train_top_layers(model, args.trainable_layers)
    first_block = shape["num_hidden_layers"] - args.trainable_layers
    optimizer = torch.optim.AdamW(trainable, lr=1e-9, fused=False)  # as the trainer's (its weights barely move)
    bf16 = resolve_bf16("auto", device, model)
    batch, advantages = rollout_batch(args.prompts, args.group, vocab=shape["vocab_size"], hidden=shape["hidden_size"],
                                      first_block=first_block, device=device, **sizes)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def way(shared: bool):
        config = NativeTrainerConfig(method="grpo", prompts_per_step=args.prompts, group_size=args.group,
                                     ppo_mini_batches=args.mini_batches, micro_batch_size=args.micro_batch,
                                     micro_batch_max_tokens=args.micro_batch_tokens,
                                     trainable_layers=args.trainable_layers, shared_prefix=shared)
        actor = actor_config(config)
        return lambda: update_policy(model, None, optimizer, trainable, batch, advantages, config, actor,
                                     bf16=bf16, step=1)

    ways = {name: way(flag) for name, flag in WAYS.items()}
    for run in ways.values():  # kernels loaded, allocator warmed
        run()
    medians, results = interleaved_medians(ways, args.repeats, sync)
    padded = float(batch.attention_mask.sum())
    print(f"the native update of {args.prompts} x {args.group} trajectories ({padded / 1e3:.0f}k tokens, "
          f"{args.mini_batches} optimiser steps, micro-batches of <= {args.micro_batch} rows and "
          f"{args.micro_batch_tokens} tokens), top {args.trainable_layers} of {shape['num_hidden_layers']} "
          f"blocks from the boundary states, bf16 {bf16}, on {args.device} (median of {args.repeats}):")
    for name, run in ways.items():
        with DispatchCount() as count:
            run()
        sync()
        stats = results[name]
        waits = f", {count.waits} waits for the device" if device.type != "cpu" else ""
        print(f"  {name:14s} {medians[name]:7.3f} s  {padded / medians[name] / 1e3:7.1f}k tokens/s  "
              f"{count.operations} operations{waits}  (policy loss {stats.sums['policy']:+.4f}, "
              f"grad norm {stats.grad_norm:.4f})")
    print(f"  ratio {medians['shared prefix'] / medians['one pass']:.2f}x (one pass over the shared prefix)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        for name, run in ways.items():
            with profile(activities=activities) as prof:
                run()
                sync()
            print(f"\n{name}: the top operations of one update")
            print(prof.key_averages().table(sort_by=key, row_limit=14))


if __name__ == "__main__":
    main()
