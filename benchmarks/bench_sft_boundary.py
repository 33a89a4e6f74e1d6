"""The warm start's SFT loop from the frozen blocks' states against the plain forward, a step's seconds.

The warm start trains the top ``--trainable-layers`` blocks of SmolLM2 on the scripted demonstrations,
about one ~930-token demonstration a step (``batch_tokens`` 1,500). On the H200 a step took ~175 ms
(docs/records/one_gpu: 400 steps in 69.8 s), where its arithmetic is a few ms: the step is its ~4,000
operations launched one by one. With the bottom blocks frozen their output on a demonstration never
changes; :func:`~spader_pipeline.modeling.warm_start.train_sft` with ``boundary_states`` runs them once
per demonstration, many demonstrations a forward, and each step from their states (~2,150 operations).

This runs ``train_sft`` itself both ways on the same demonstrations and settings (the one-GPU run's:
``conf/one_gpu`` over ``conf/base``): ``--steps`` steps, the frozen blocks' forwards included in the
second, interleaved over ``--repeats``; a step's milliseconds and the plain loop's over the other. Both
train from the same random weights each repeat, so the two take the same batches; their losses are
printed side by side (the same to bf16's rounding: the frozen blocks' states come from other kernels).

SmolLM2-135M's shape with random weights (``--smoke``: 2 blocks, a small vocabulary), bf16 autocast on
CUDA and on a CPU with native bf16 (``bf16: auto``), demonstrations shaped as the warm start's: a shared
144-token instruction, then 450-1,100 tokens, ~10% of them the model's.

    python benchmarks/bench_sft_boundary.py [--steps 40] [--repeats 3] [--device cuda] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import random

import smoke
import torch
from bench_gpu_decode_step import SMOLLM2_135M
from timing import interleaved_medians
from transformers import LlamaConfig, LlamaForCausalLM

from spader_pipeline.modeling.warm_start import SFTExample, WarmStartConfig, train_sft

WAYS = {"plain forward": False, "from boundary states": True}


def demonstrations(count: int, vocab: int, *, instruction: int, shortest: int, longest: int,
                   seed: int = 0) -> list[SFTExample]:
    """Demonstration-shaped examples: a shared instruction, then assistant turns (loss) between observations."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(instruction)]
    examples = []
    for _ in range(count):
        length = rng.randint(shortest, longest)
        ids = prefix + [rng.randrange(3, vocab) for _ in range(length)]
        mask = [0] * len(ids)
        for turn in range(instruction, len(ids), 100):  # ~10 model tokens every 100
            mask[turn : turn + 10] = [1] * len(mask[turn : turn + 10])
        examples.append(SFTExample(tuple(ids), tuple(mask)))
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--demonstrations", type=int, default=64)
    parser.add_argument("--trainable-layers", type=int, default=8)
    parser.add_argument("--batch-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = smoke.parse_args(parser, steps=3, demonstrations=4, trainable_layers=1, repeats=1)
    shape = {**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 4096} if args.smoke else SMOLLM2_135M
    sizes = dict(instruction=16, shortest=20, longest=60) if args.smoke else dict(instruction=144, shortest=450,
                                                                                   longest=1100)
    torch.manual_seed(0)
    initial = LlamaForCausalLM(LlamaConfig(**shape)).to(args.device)
    examples = demonstrations(args.demonstrations, shape["vocab_size"], **sizes)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def way(boundary: bool):
        def train(model):
            config = WarmStartConfig(max_steps=args.steps, schedule_steps=240, batch_tokens=args.batch_tokens,
                                     learning_rate=6e-4, warmup_steps=10, trainable_layers=args.trainable_layers,
                                     boundary_states=boundary, log_every=1)
            losses: list[float] = []
            summary = train_sft(model, examples, config, pad_id=0, on_log=lambda _, m: losses.append(m["loss"]))
            return summary, losses
        return train

    medians, results = interleaved_medians({name: way(flag) for name, flag in WAYS.items()}, args.repeats, sync,
                                           prepare=lambda: copy.deepcopy(initial))
    print(f"the warm start's SFT, {args.steps} steps of {args.batch_tokens} tokens, top {args.trainable_layers} "
          f"of {shape['num_hidden_layers']} blocks trained, on {args.device} (median of {args.repeats}):")
    for name, seconds in medians.items():
        summary, losses = results[name]
        print(f"  {name:22s} {seconds * 1e3 / args.steps:8.1f} ms a step  ({summary['examples_seen']:.0f} "
              f"demonstrations; frozen blocks {summary['boundary_seconds']:.2f} s; last losses "
              f"{', '.join(f'{x:.3f}' for x in losses[-3:])})")
    print(f"  ratio {medians['plain forward'] / medians['from boundary states']:.2f}x")


if __name__ == "__main__":
    main()
