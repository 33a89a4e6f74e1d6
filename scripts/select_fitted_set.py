"""Choose ``make positive-control``'s fitted set: training questions on which RL has a signal to learn.

A group-relative advantage is zero for a group whose trajectories all earn the same reward
(``adv/zero_frac``, docs/metrics.md), so a question the warm start always fails, or always answers
the same way, teaches nothing in a few steps. This script samples the warm start on ``--candidates``
training questions (a seeded draw, ``--candidate-seed``), ``--samples`` trajectories each at the RL
temperature, plus one greedy trajectory, and ranks the questions by how much their sampled recall
varies (population standard deviation; ties: the higher sampled mean). The first ``--pick`` are the
fitted set, written as ``positive_control.question_ids`` for ``conf/positive_control``.

The draw is from the **training** split only, with the warm start's own samples: nothing about the
validation or test splits, nor about any trained policy, enters the choice. The greedy column is
printed as a reference; it is not used to rank (choosing low greedy scores would build regression to
the mean into the step-0 level).

Run after the warm start exists (``make positive-control`` builds it first, or ``kedro run --env
positive_control --pipeline positive_control --to-nodes warm_start``)::

    PYTHONPATH=src python scripts/select_fitted_set.py --env positive_control --candidates 16 --samples 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.algorithms import score_answers
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.reporting.tables import markdown_table
from spader_pipeline.retrieval.settings import search_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_warm_start_diversity import _context  # noqa: E402


def rank_by_spread(rows: list[dict]) -> list[dict]:
    """``rows`` (each with ``sampled``: the recalls of its samples) ordered by the spread of ``sampled``
    (population standard deviation), then by its mean, both descending; the order is stable. Spreads
    equal up to float rounding (recalls are fractions of answers) count as ties."""
    return sorted(rows, key=lambda r: (-round(statistics.pstdev(r["sampled"]), 9), -statistics.mean(r["sampled"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="positive_control")
    parser.add_argument("--candidates", type=int, default=16, help="training questions sampled")
    parser.add_argument("--candidate-seed", type=int, default=123, help="seed of the candidates' draw")
    parser.add_argument("--samples", type=int, default=8, help="trajectories per candidate")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the environment's training.native.temperature)")
    parser.add_argument("--pick", type=int, default=4, help="questions in the fitted set")
    parser.add_argument("--rows", type=int, default=16, help="trajectories decoded together")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="/tmp/select_fitted_set.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = _context(args.env)
    params, catalog = context.params, context.catalog
    native = params["training"]["native"]
    temperature = float(native["temperature"] if args.temperature is None else args.temperature)
    train = samples_from_verl(catalog.load("verl_train"))
    order = np.random.default_rng(args.candidate_seed).permutation(len(train))[: args.candidates]
    candidates = [train[int(i)] for i in order]
    model, tokenizer = load_model_and_tokenizer(catalog.load("warm_start_manifest")["path"], device="cpu")
    model.eval()
    bf16 = resolve_bf16(native.get("bf16", "auto"), "cpu", model)
    rollout = RolloutConfig.from_mapping(native["rollout"])
    template = resolve_template(params["prompt"])
    limits = {"max_prompt_tokens": int(native["max_prompt_tokens"]), "bf16": bf16}
    new_tokens = int(native["max_new_tokens"])
    started = time.perf_counter()
    with search_backend(params["training"].get("search"), catalog.load("index_manifest")["index_dir"],
                        where="training.search") as search:
        greedy = run_rollouts_sync(candidates, HFGenerator(model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=new_tokens),
                                                           micro_batch_size=len(candidates), **limits),
                                   search, rollout, template)
        group = [q for q in candidates for _ in range(args.samples)]
        sampler = HFGenerator(model, tokenizer, SamplingParams(temperature=temperature, max_new_tokens=new_tokens,
                                                         seed=args.candidate_seed),
                              micro_batch_size=args.rows, **limits)
        sampled = [t for first in range(0, len(group), args.rows)
                   for t in run_rollouts_sync(group[first:first + args.rows], sampler, search, rollout, template)]
    seconds = time.perf_counter() - started
    rows = []
    for k, question in enumerate(candidates):
        truth = question["ground_truth"]
        rows.append({
            "id": str(question["id"]), "question": question["question"], "answers": len(truth),
            "greedy": score_answers(list(greedy[k].predicted or ()), truth).recall,
            "sampled": [score_answers(list(t.predicted or ()), truth).recall
                        for t in sampled[k * args.samples:(k + 1) * args.samples]],
        })
    ranked = rank_by_spread(rows)
    table = [[r["id"], r["answers"], f"{statistics.pstdev(r['sampled']):.3f}", f"{statistics.mean(r['sampled']):.3f}",
              f"{max(r['sampled']):.2f}", f"{r['greedy']:.3f}", r["question"][:60]] for r in ranked]
    print(markdown_table(pd.DataFrame(table, columns=["id", "answers", "sampled recall sd", "mean", "max", "greedy",
                                                      "question"])))
    picked = [r["id"] for r in ranked[: args.pick]]
    print(f"\npositive_control.question_ids: [{', '.join(picked)}]")
    print(f"({args.candidates} candidates x {args.samples} samples at T={temperature} and one greedy each, "
          f"{seconds:.0f} s, {args.threads} threads)")
    Path(args.out).write_text(json.dumps({"picked": picked, "temperature": temperature, "rows": ranked,
                                          "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
