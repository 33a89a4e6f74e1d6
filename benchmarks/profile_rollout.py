"""One RL rollout as the native trainer runs it, timed per decoding step, in two weight layouts.

The native trainer's step on a GPU is its rollout, and a real rollout's decoding step costs three to
four times what ``bench_gpu_decode_step.py`` gives for the same shape (docs/gpu.md, "Rollout speed on
one GPU"). This runs what ``native.trainer.collect_rollouts`` runs (``HFGenerator`` on the training
questions of a bundle, sampled at T = 1, groups of ``--group``, the bundle's rollout limits and search,
boundary states captured as with ``trainable_layers: 8``) for each layout:

- ``autocast``: fp32 weights under bf16 autocast where ``bf16: auto`` turns it on (a GPU, a CPU with
  bf16 units; plain fp32 elsewhere), as the trainer decodes today;
- ``bf16``: a bf16 copy of the weights, no autocast (what a rollout copy refreshed after each update
  would decode with);
- ``autocast_bf16_values``: ``autocast`` with the KV cache's values kept in bf16 on a CPU (before
  ``GrowingLayer.fp32_values_on_cpu``: each decoding step then casts every cached value to fp32);

and prints per layout the rollout's wall time, the time in the model's turns and of it the turns'
prefill forwards and their decoding steps, the share of the prefills' positions that were padding
(``--gpu-prefill``: laid out as a GPU lays them, on any device), its decoding steps, the time per step, and
whether its trajectories' text equals the first layout's. ``--profile`` adds
torch.profiler's top operations of the first layout's rollout (CPU and, on CUDA, device time), to place
the time a step spends beyond the decoding benchmark.
Same questions and seed for every layout; the straightforward layout (today's) is the first row.

    python benchmarks/profile_rollout.py --model-dir /tmp/one_gpu/warm_start --bundle /tmp/stage/bundle \\
        --questions 48 --group 16 --device cuda [--max-turns 6] [--profile]
    python benchmarks/profile_rollout.py --smoke    (the tiny model, 2 x 2 trajectories, on the CPU without a GPU)
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import pandas as pd
import smoke
import torch

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.modeling.decode import GPU_PREFILL_BLOCK_COST
from spader_pipeline.modeling.kv_cache import GrowingLayer
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.retrieval.settings import search_backend


def rollout(model, tokenizer, group, search, limits, template, *, bf16: bool, capture: int | None, device: str,
            prefill_block_cost="auto"):
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    generator = HFGenerator(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=96, seed=1),
                            max_prompt_tokens=1024, micro_batch_size=len(group), bf16=bf16,
                            capture_states_from_layer=capture, prefill_block_cost=prefill_block_cost)
    torch.manual_seed(0)
    sync()
    started = time.perf_counter()
    trajectories = run_rollouts_sync(group, generator, search, limits, template)
    sync()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "texts": [t.messages for t in trajectories],
            "model_seconds": generator.model_seconds, "decode_steps": generator.decode_steps,
            "ms_per_step": 1000 * generator.model_seconds / max(generator.decode_steps, 1),
            "model_tokens": generator.generated_tokens, "prefill_seconds": generator.prefill_seconds,
            "decoding_seconds": generator.decoding_seconds,
            "prefill_padding": 1 - generator.prefill_tokens / max(generator.prefill_positions, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a Hugging Face folder (the warm start); required but with --smoke")
    parser.add_argument("--bundle", help="a portable bundle (questions, index, settings); required but with --smoke")
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-turns", type=int, default=None, help="default: the bundle's training rollout")
    parser.add_argument("--layouts", default="autocast,bf16")
    parser.add_argument("--capture-block", type=int, default=21,
                        help="decoder block whose output is captured (trainable_layers 8 of 30: 21); -1: none")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--gpu-prefill", action="store_true",
                        help="lay continued turns' prefills out as on a GPU (one forward unless padding costs more: "
                             "GPU_PREFILL_BLOCK_COST) on any device, for the padding share a GPU computes")
    # --smoke: benchmarks/smoke.py's tiny model (2 blocks), index and questions, 2 x 2 trajectories, every layout
    args = smoke.parse_args(parser, questions=2, group=2, layouts="autocast,bf16,autocast_bf16_values",
                            capture_block=1)
    if not args.smoke and not (args.model_dir and args.bundle):
        parser.error("--model-dir and --bundle are required (or --smoke)")

    if args.smoke:
        limits, template, index = dict(smoke.trainer_settings()["rollout"]), smoke.prompt_template(), smoke.index_dir()
        samples = smoke.questions(args.questions)
        model_dir = args.model_dir or smoke.model_dir()
    else:
        bundle = Path(args.bundle)
        settings = json.loads((bundle / "settings.json").read_text())
        limits, template, index = dict(settings["training"]["native"]["rollout"]), settings["prompt_template"], bundle / "index"
        samples = samples_from_verl(pd.read_parquet(bundle / "train.parquet"))[: args.questions]
        model_dir = args.model_dir
    if args.max_turns is not None:
        limits["max_turns"] = args.max_turns
    limits = RolloutConfig.from_mapping(limits)
    group = [{**q, "uid": f"1-{k}"} for k, q in enumerate(samples) for _ in range(args.group)]
    model, tokenizer = load_model_and_tokenizer(model_dir, device=args.device)
    capture = None if args.capture_block < 0 else args.capture_block
    rows = []
    with search_backend({"mode": "local"}, str(index), where="profile_rollout") as search:
        for i, layout in enumerate(args.layouts.split(",")):
            policy = model if layout.startswith("autocast") else copy.deepcopy(model).to(torch.bfloat16)
            bf16 = layout.startswith("autocast") and resolve_bf16("auto", args.device, model)
            GrowingLayer.fp32_values_on_cpu = layout != "autocast_bf16_values"
            profiler = None
            if args.profile and i == 0:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if args.device.startswith("cuda"):
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                # the generator decodes in a worker thread (the rollout's event loop stays free)
                profiler = torch.profiler.profile(
                    activities=activities,
                    experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))
                profiler.__enter__()
            result = rollout(policy, tokenizer, group, search, limits, template, bf16=bf16,
                             capture=capture, device=args.device,
                             prefill_block_cost=GPU_PREFILL_BLOCK_COST if args.gpu_prefill else "auto")
            if profiler is not None:
                profiler.__exit__(None, None, None)
                for key in ("self_cpu_time_total", "self_device_time_total" if args.device != "cpu" else None):
                    if key:
                        print(profiler.key_averages().table(sort_by=key, row_limit=25))
            rows.append({"layout": layout, **result})
            if policy is not model:
                del policy
    print(f"{len(group)} trajectories ({args.questions} questions x {args.group}), {args.device}, "
          f"{limits.max_turns} turns, capture block {capture}")
    print(f"{'layout':22s} {'rollout s':>10s} {'model s':>8s} {'prefill s':>9s} {'decoding s':>10s} {'padding':>8s} "
          f"{'steps':>6s} {'ms/step':>8s} {'tokens':>7s} {'same text':>9s}")
    for row in rows:
        same = row["texts"] == rows[0]["texts"]
        print(f"{row['layout']:22s} {row['seconds']:10.1f} {row['model_seconds']:8.1f} {row['prefill_seconds']:9.1f} "
              f"{row['decoding_seconds']:10.1f} {row['prefill_padding']:8.2f} {row['decode_steps']:6d} "
              f"{row['ms_per_step']:8.1f} {row['model_tokens']:7d} {str(same):>9s}")
    if len(rows) > 1:
        print(f"ratio {rows[0]['model_seconds'] / rows[1]['model_seconds']:.2f}x ({rows[0]['layout']} / {rows[1]['layout']})")


if __name__ == "__main__":
    main()
