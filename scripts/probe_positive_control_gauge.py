"""Probe a gauge for ``make positive-control``: how far do the decoder's numerics move a policy's score?

The positive control's verdict flipped between commits whose decoders differ only within their tested
bf16 bounds (docs/results.md). This script scores fixed policies (the warm start and each cell's final
model of a finished ``make positive-control``) on the fitted questions with two gauges:

- ``greedy``: one greedy trajectory per question, each question decoded alone (the current gauge);
- ``T<t>``: ``--samples`` trajectories per question at each of ``--temperatures``, one question's rows decoded
  together from a generator seeded by the question's position (the same random stream for every policy),

under two numerics the tests accept as equal within a bound: the default decoder (the C++ step, keys
cached in bf16) and ``--numerics python`` (the Python step, fp32 key cache). Each (policy, numerics)
writes the recall and F1 (the RL reward) of every trajectory, so the spread a gauge shows between numerics on the *same*
weights, and the gain it shows from the warm start, can be read side by side. Run in the project whose
``make positive-control`` finished (its data root holds the models)::

    PYTHONPATH=src python scripts/probe_positive_control_gauge.py --numerics default --out /tmp/gauge_default.json
    PYTHONPATH=src python scripts/probe_positive_control_gauge.py --numerics python --out /tmp/gauge_python.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.algorithms import score_answers
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.retrieval.settings import search_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_warm_start_diversity import _context  # noqa: E402


def set_numerics(name: str) -> None:
    """``default``: the C++ step over the bf16 key cache; ``python``: the Python step, fp32 keys."""
    if name == "python":
        from spader_pipeline.modeling import decode_attention, native_step

        native_step.NATIVE_STEP = False
        decode_attention.BF16_CACHE = False
    elif name != "default":
        raise SystemExit(f"--numerics {name}: use default or python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="positive_control")
    parser.add_argument("--numerics", default="default")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 0.3])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--policies", nargs="*", default=None,
                        help="name=path; default: the warm start and every fit_* cell's final model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_numerics(args.numerics)
    context = _context(args.env)
    params, catalog = context.params, context.catalog
    native = params["training"]["native"]
    fitted = samples_from_verl(catalog.load("fitted_train"))
    policies = dict(p.split("=", 1) for p in args.policies) if args.policies else default_policies(catalog, params)
    rollout = RolloutConfig.from_mapping(native["rollout"])
    template = resolve_template(params["prompt"])
    new_tokens, prompt_tokens = int(native["max_new_tokens"]), int(native["max_prompt_tokens"])
    rows = []
    with search_backend(params["training"].get("search"), catalog.load("index_manifest")["index_dir"],
                        where="training.search") as search:
        for name, path in policies.items():
            started = time.perf_counter()
            model, tokenizer = load_model_and_tokenizer(path, device="cpu")
            model.eval()
            bf16 = resolve_bf16(native.get("bf16", "auto"), "cpu", model)
            limits = {"max_prompt_tokens": prompt_tokens, "bf16": bf16}
            for k, question in enumerate(fitted):
                truth = question["ground_truth"]
                greedy = run_rollouts_sync([question], HFGenerator(
                    model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=new_tokens),
                    micro_batch_size=1, **limits), search, rollout, template)
                score = score_answers(list(greedy[0].predicted or ()), truth)
                row = {"policy": name, "numerics": args.numerics, "question": str(question["id"]),
                       "greedy": score.recall, "greedy_f1": score.f1}
                for temperature in args.temperatures:
                    sampled = run_rollouts_sync([question] * args.samples, HFGenerator(
                        model, tokenizer, SamplingParams(temperature=temperature, max_new_tokens=new_tokens,
                                                         seed=1000 + k), micro_batch_size=args.samples, **limits),
                        search, rollout, template)
                    scores = [score_answers(list(t.predicted or ()), truth) for t in sampled]
                    row[f"T{temperature}"] = [x.recall for x in scores]
                    row[f"T{temperature}_f1"] = [x.f1 for x in scores]
                rows.append(row)
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
            del model
    Path(args.out).write_text(json.dumps({"temperatures": args.temperatures, "samples": args.samples, "rows": rows}, indent=1))


def default_policies(catalog, params) -> dict[str, str]:
    """The warm start and each cell's final model under the positive control's output directory."""
    policies = {"warm_start": catalog.load("warm_start_manifest")["path"]}
    root = Path(params["positive_control"]["output_dir"])
    for final in sorted(root.glob("*/*/final")):
        policies[final.parent.parent.name + "/" + final.parent.name] = str(final)
    return policies


if __name__ == "__main__":
    main()
