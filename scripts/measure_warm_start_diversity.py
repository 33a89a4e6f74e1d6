"""Choose the warm start's stopping step by measurement (issue: room to explore at RL step 1).

Trains the warm start of a Kedro environment's settings (default ``compare``: the multi-search task)
once for ``--max-steps`` steps, saves snapshots at ``--snapshots``, and for each snapshot samples
groups as the first RL step does (``training.native``: temperature, ``group_size``, rollout limits)
on ``--questions`` training questions, then runs it greedy on the first ``--val-questions`` questions
of the **validation** split (the stopping step is chosen there, never on the test split). Prints per
snapshot: the share of groups with ≥ 2 distinct query sequences (``group/diverse_frac``,
docs/metrics.md), distinct query sequences per group, searches per trajectory, valid-turn and
answered rates, answer recall (sampled), answer turns cut by ``max_new_tokens``, and the greedy
validation recall with a 95% bootstrap interval over questions.

The snapshots are the first ``s`` steps of the same learning-rate schedule (its horizon is
``--max-steps``), so ``warm_start.sft: {max_steps: s, schedule_steps: <max-steps>}`` reproduces
snapshot ``s`` exactly. Run after the data and index exist (``kedro run --env compare
--pipelines data_prep,index_build,base_model``)::

    PYTHONPATH=src python scripts/measure_warm_start_diversity.py --env compare --max-steps 240 \\
        --snapshots 40,80,160,240 --questions 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.scripted import ScriptedPolicy
from spader_pipeline.agent.tokens import examples_from_dialogues
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.algorithms import score_answers
from spader_pipeline.algorithms.group_metrics import normalise_query
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.evaluation.bootstrap import bootstrap_interval
from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.modeling.warm_start import WarmStartConfig, train_sft
from spader_pipeline.reporting.tables import markdown_table
from spader_pipeline.retrieval.settings import search_backend
from spader_pipeline.typed_config import from_mapping

ROOT = Path(__file__).resolve().parents[1]


def _context(env: str):
    """The Kedro context of ``env`` (parameters and catalog, read the way a run reads them)."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(ROOT)
    return KedroSession.create(project_path=ROOT, env=env).load_context()


def _query_sequence(trajectory) -> tuple:
    return tuple(tuple(normalise_query(q) for q in s.queries) for s in trajectory.steps if s.kind == "search")


def truncated_answers(trajectories, max_new_tokens: int) -> tuple[int, int]:
    """(answer turns cut at ``max_new_tokens`` before their closing tag, turns that opened an answer)."""
    opened = [s for t in trajectories for s in t.steps if "<answer>" in s.text]
    cut = [s for s in opened if s.kind != "answer" and s.token_span is not None
           and s.token_span[1] - s.token_span[0] >= max_new_tokens]
    return len(cut), len(opened)


def greedy_validation(model, tokenizer, samples, search, native: dict, template: str) -> dict[str, float]:
    """Greedy rollouts on validation questions with RL's limits: recall with its interval over questions."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=int(native["max_new_tokens"]))
    generator = HFGenerator(model, tokenizer, sampling, max_prompt_tokens=int(native["max_prompt_tokens"]),
                            micro_batch_size=len(samples))
    trajectories = run_rollouts_sync(samples, generator, search, RolloutConfig.from_mapping(native["rollout"]), template)
    scores = [score_answers(list(t.predicted or ()), s["ground_truth"]) for t, s in zip(trajectories, samples, strict=True)]
    recall = bootstrap_interval(np.array([[x.recall for x in scores]]))
    cut, opened = truncated_answers(trajectories, int(native["max_new_tokens"]))
    return {"val_recall": recall.mean, "val_recall_low": recall.low, "val_recall_high": recall.high,
            "val_f1": statistics.mean(x.f1 for x in scores),
            "val_searches": statistics.mean(sum(s.kind == "search" for s in t.steps) for t in trajectories),
            "val_answer_turns_cut": cut / max(opened, 1)}


def sample_groups(model, tokenizer, samples, search, native: dict, template: str, seed: int) -> dict[str, float]:
    """The first RL step's sampling on ``samples``: ``group_size`` trajectories each."""
    group_size = int(native["group_size"])
    group = [{**q, "uid": f"g{k}"} for k, q in enumerate(samples) for _ in range(group_size)]
    sampling = SamplingParams(temperature=float(native["temperature"]), max_new_tokens=int(native["max_new_tokens"]),
                              seed=seed)
    generator = HFGenerator(model, tokenizer, sampling, max_prompt_tokens=int(native["max_prompt_tokens"]),
                            micro_batch_size=len(group))
    started = time.perf_counter()
    trajectories = run_rollouts_sync(group, generator, search, RolloutConfig.from_mapping(native["rollout"]), template)
    seconds = time.perf_counter() - started
    distinct = []
    for k in range(len(samples)):
        members = trajectories[k * group_size:(k + 1) * group_size]
        distinct.append(len({_query_sequence(t) for t in members}))
    turns = [s for t in trajectories for s in t.steps]
    recall = [score_answers(list(t.predicted or ()), s["ground_truth"]).recall for t, s in zip(trajectories, group, strict=True)]
    cut, opened = truncated_answers(trajectories, int(native["max_new_tokens"]))
    return {
        "answer_turns_cut": cut / max(opened, 1),
        "diverse_frac": sum(n >= 2 for n in distinct) / len(distinct),
        "distinct_query_seqs": statistics.mean(distinct),
        "searches": statistics.mean(sum(s.kind == "search" for s in t.steps) for t in trajectories),
        "valid_turn_rate": sum(s.kind != "invalid" for s in turns) / max(len(turns), 1),
        "answered_rate": sum(t.predicted is not None for t in trajectories) / len(trajectories),
        "recall": statistics.mean(recall),
        "rollout_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="compare")
    parser.add_argument("--max-steps", type=int, default=240)
    parser.add_argument("--snapshots", default="40,80,160,240")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--out", default="/tmp/warm_start_diversity")
    parser.add_argument("--val-questions", type=int, default=49,
                        help="greedy validation questions per snapshot (the first N of verl_validation; 0: none)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = _context(args.env)
    params, catalog = context.params, context.catalog
    warm, native = params["warm_start"], params["training"]["native"]
    base = catalog.load("base_model_manifest")
    index_dir = catalog.load("index_manifest")["index_dir"]
    train = catalog.load("verl_train")
    validation = samples_from_verl(catalog.load("verl_validation"))[: args.val_questions]
    template = resolve_template(params["prompt"])
    snapshots = sorted(int(s) for s in args.snapshots.split(","))
    out = Path(args.out)

    model, tokenizer = load_model_and_tokenizer(base["path"])
    demo_rollout = RolloutConfig.from_mapping(warm["rollout"])
    samples = samples_from_verl(train, warm.get("max_demonstrations"), int(warm.get("seed", 0)))
    with search_backend(warm.get("search"), index_dir, where="warm_start.search") as search:
        demos = run_rollouts_sync(samples, ScriptedPolicy(**warm.get("scripted", {})), search, demo_rollout, template)
    conversations = [t.messages for t in demos if t.predicted is not None]
    examples = examples_from_dialogues(tokenizer, conversations, model_type=model.config.model_type,
                                       max_length=warm.get("max_length"))
    answer_tokens = [len(tokenizer(m["content"])["input_ids"]) for c in conversations for m in c
                     if m["role"] == "assistant" and "<answer>" in m["content"]]
    searches = [sum(s.kind == "search" for s in t.steps) for t in demos]
    print(f"demonstrations {len(examples)}; searches/demo {statistics.mean(searches):.2f}; "
          f"answer-turn tokens median {statistics.median(answer_tokens)} max {max(answer_tokens)}; "
          f"distinct first queries {len({_query_sequence(t)[:1] for t in demos})}", flush=True)

    sft = {**warm["sft"], "max_steps": args.max_steps, "max_seconds": None, "log_every": 10}
    config = from_mapping(WarmStartConfig, sft, where="warm_start.sft")

    probe = samples_from_verl(train, args.questions, seed=int(native.get("seed", 0)) + 1)
    rows = []

    def measure(step: int) -> None:
        """Score the model as it is after ``step`` SFT steps; the training's RNG state is kept, so the
        run goes on exactly as without the measurement."""
        rng = torch.get_rng_state(), random.getstate()
        model.eval()
        with torch.no_grad(), search_backend({"mode": "local"}, index_dir, where="probe") as search:
            result = sample_groups(model, tokenizer, probe, search, native, template, seed=0)
            if validation:
                result.update(greedy_validation(model, tokenizer, validation, search, native, template))
        model.train()
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        rows.append({"sft_steps": step, **result})
        print(json.dumps(rows[-1]), flush=True)

    def snapshot(step: int, metrics: dict) -> None:
        print(f"  sft step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()), flush=True)
        if step in snapshots:
            model.save_pretrained(out / f"step{step}")
            tokenizer.save_pretrained(out / f"step{step}")
            measure(step)

    started = time.perf_counter()
    summary = train_sft(model, examples, config, pad_id=tokenizer.pad_token_id, on_log=snapshot)
    print(f"sft: {json.dumps(summary)} in {time.perf_counter() - started:.0f} s (measurements included)", flush=True)
    print(markdown_table(pd.DataFrame(rows).round(3)))


if __name__ == "__main__":
    main()
