"""SPA advantage and SPADER reward on a paper-sized batch: vectorised core vs straightforward loops.

    .venv/bin/python benchmarks/bench_algorithms.py [--repeats 5] [--loop-repeats 3] [--seed 0] [--threads 1]
                                                    [--pool 150 | --distinct-docs] [--smoke]

Batch (issue 3): 32 prompts × 16 rollouts = 512 responses × 8192 tokens, ~8 decision steps each,
~15 gold entities per prompt with 1–3 aliases, 5 retrieved documents of ~100 words per step
(~1.9M document words). The 16 rollouts of a prompt search for the same question, so their
documents come from a per-prompt pool of ``--pool`` passages (default 150: 560 retrievals per
prompt share ~150 distinct passages); ``--distinct-docs`` makes every retrieval a new passage
(the worst case for document deduplication).

Compared, on identical inputs, in one run:

* **SPA**: ``algorithms.advantages.spa_advantage`` vs a per-token loop in the reference's style
  (step spans found with one ``tensor.item()`` per token, per-group per-step Python statistics,
  per-token writes, as the SPADER reference code does).
* **SPADER reward** (step extraction + discovery in retrieved documents + group novelty + tool cost +
  token placement): ``algorithms.rewards.discover_entities`` + ``spader_rewards`` vs the published
  reward manager's loop (KhanCold/spader): one ``.item()`` per token for the steps, the step's tool text
  normalised per trajectory and step, one substring test per entity, alias and step, ``N(e)``
  counted over the batch per new entity.
* **discovery only**: the same discovery part of both (normalisation + matching), shown separately.

Medians over the repeats; results must agree to max |diff| ≤ 1e-5. ``os.getloadavg()`` is printed
next to each figure (the machine is shared).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import smoke
import torch

from spader_pipeline.algorithms.advantages import spa_advantage
from spader_pipeline.algorithms.matching import normalize_answer, normalize_ground_truth
from spader_pipeline.algorithms.rewards import SpaderRewardConfig, discover_entities, spader_rewards

PROMPTS, GROUP, LENGTH, STEPS, ENTITIES, DOCS, WORDS = 32, 16, 8192, 8, 15, 5, 100
GLOBAL_STEP = 150  # inside the tool-cost ramp, so the cost term is exercised

# ----------------------------------------------------------------------------- data


def _document(rng, vocab, aliases) -> str:
    words = list(rng.choice(vocab, size=WORDS))
    if rng.random() < 0.4:
        alias = rng.choice(aliases[int(rng.integers(len(aliases)))])
        words.insert(int(rng.integers(WORDS)), str(alias).title())
    return "Doc (Title: " + " ".join(words[:3]) + ") " + " ".join(words) + "."


def make_batch(seed: int, pool: int | None = 150):
    """``pool``: distinct passages per prompt that its rollouts retrieve from; ``None``: all distinct."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(5000)] + ["the", "a", "of", "and", "in"]
    bsz = PROMPTS * GROUP
    index = np.array([f"uid{i // GROUP}" for i in range(bsz)], dtype=object)
    gts = []
    for _ in range(PROMPTS):
        gt = []
        for e in range(ENTITIES):
            n_alias = int(rng.integers(1, 4))
            gt.append(
                [
                    " ".join(rng.choice(vocab[:4000], size=int(rng.integers(1, 3)))) + f" e{e}"
                    for _ in range(n_alias)
                ]
            )
        gts.append(gt)
    ground_truths = [gts[i // GROUP] for i in range(bsz)]
    pools = [[_document(rng, vocab, gts[p]) for _ in range(pool)] for p in range(PROMPTS)] if pool else None
    mask = torch.zeros(bsz, LENGTH, dtype=torch.long)
    docs, counts = [], []
    for i in range(bsz):
        k = int(rng.integers(STEPS - 2, STEPS + 3))
        # model turns of 60–200 tokens separated by observations filling the rest of ~7600 tokens
        pos = 0
        spans = []
        for _ in range(k):
            span = int(rng.integers(60, 200))
            spans.append((pos, pos + span))
            pos += span + int(rng.integers(500, 700))
        scale = (LENGTH - 400) / max(pos, 1)
        for a, b in spans:
            a2, b2 = int(a * scale), int(a * scale) + (b - a)
            mask[i, a2 : min(b2, LENGTH)] = 1
        step_docs, step_counts = [], []
        for s in range(k):
            if s == k - 1:  # the answer turn retrieves nothing
                step_docs.append([])
                step_counts.append(0)
                continue
            if pools is not None:
                picks = rng.choice(pool, size=DOCS, replace=False)
                step_docs.append([pools[i // GROUP][int(j)] for j in picks])
            else:
                step_docs.append([_document(rng, vocab, ground_truths[i]) for _ in range(DOCS)])
            step_counts.append(int(rng.integers(1, 4)))
        docs.append(step_docs)
        counts.append(step_counts)
    rewards = torch.zeros(bsz, LENGTH)
    f1 = torch.tensor(rng.random(bsz), dtype=torch.float32)
    ok = torch.tensor(rng.random(bsz) < 0.9)
    # SPA input: random step rewards on each step's last token
    for i in range(bsz):
        ends = (mask[i, :-1] - mask[i, 1:] == 1).nonzero().flatten()
        rewards[i, ends] = torch.rand(len(ends))
    return index, ground_truths, mask, docs, counts, rewards, f1, ok


# ----------------------------------------------------------------------------- loops


def loop_steps(row: torch.Tensor) -> list[tuple[int, int]]:
    spans, start = [], None
    for t in range(row.shape[0]):
        if row[t].item():
            if start is None:
                start = t
        elif start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, row.shape[0]))
    return spans


def loop_spa(rewards, mask, index, gamma=1.0, eps=1e-6):
    bsz, length = mask.shape
    spans = [loop_steps(mask[i]) for i in range(bsz)]
    width = max(len(s) for s in spans)
    g = [[0.0] * width for _ in range(bsz)]
    for i in range(bsz):
        run = 0.0
        for t in range(len(spans[i]) - 1, -1, -1):
            run = rewards[i, spans[i][t][1] - 1].item() + gamma * run
            g[i][t] = run
    groups: dict[object, list[int]] = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(i)
    adv = torch.zeros(bsz, length)
    for members in groups.values():
        for t in range(width):
            vals = [g[j][t] for j in members]
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals) + eps)
            for j in members:
                if t < len(spans[j]):
                    a = (g[j][t] - mu) / sd
                    for k in range(*spans[j][t]):
                        adv[j, k] = a
    return adv


def loop_discovery(ground_truths, docs):
    """Per trajectory and step: normalise the step's tool text (its documents, one per line), then one
    whole-word substring test per entity and alias (the SPADER reference's discovery, with the project's alias-aware,
    word-bounded matching so that both sides compute the same thing)."""
    found = []
    for gt_raw, step_docs in zip(ground_truths, docs, strict=True):
        gt = normalize_ground_truth(gt_raw)
        per_step = []
        for texts in step_docs:
            padded = " " + normalize_answer("\n".join(texts)) + " "
            per_step.append(
                {e for e, aliases in enumerate(gt.aliases) if any(f" {a} " in padded for a in aliases)}
            )
        found.append((len(gt), per_step))
    return found


def loop_reward(mask, index, ground_truths, docs, counts, f1, ok, cfg: SpaderRewardConfig):
    bsz, length = mask.shape
    if cfg.tool_round_cost == 0 or GLOBAL_STEP < cfg.cost_free_steps:
        c_eff = 0.0
    elif cfg.cost_rampup_steps > 0 and GLOBAL_STEP - cfg.cost_free_steps < cfg.cost_rampup_steps:
        c_eff = cfg.tool_round_cost * (GLOBAL_STEP - cfg.cost_free_steps) / cfg.cost_rampup_steps
    else:
        c_eff = cfg.tool_round_cost
    found = loop_discovery(ground_truths, docs)
    traj_found = [set().union(*per_step) if per_step else set() for _, per_step in found]
    out = torch.zeros(bsz, length)
    for i in range(bsz):
        n_gt, per_step = found[i]
        spans = loop_steps(mask[i])
        seen: set[int] = set()
        for s, (_, b) in enumerate(spans):
            r = 0.0
            if s < len(per_step) and n_gt:
                for e in per_step[s] - seen:
                    n_e = sum(1 for j in range(bsz) if index[j] == index[i] and e in traj_found[j])
                    r += cfg.alpha + cfg.beta * math.exp(-cfg.lam * (n_e - 1))
                seen |= per_step[s]
                r = (r - c_eff * counts[i][s]) / n_gt
            if s == len(spans) - 1:
                r += cfg.final_answer_weight * float(f1[i]) if bool(ok[i]) else -cfg.format_penalty
            out[i, b - 1] += r
    return out


# ----------------------------------------------------------------------------- vectorised


def fast_reward(mask, index, ground_truths, docs, counts, f1, ok, cfg):
    width = max(len(d) for d in docs)
    found, num_gt = discover_entities(ground_truths, docs, num_steps=width)
    q = torch.zeros(len(docs), width)
    for i, c in enumerate(counts):
        q[i, : len(c)] = torch.tensor(c, dtype=torch.float32)
    out = spader_rewards(
        mask,
        index,
        f1=f1,
        format_ok=ok,
        global_step=GLOBAL_STEP,
        config=cfg,
        found=found,
        num_gt=num_gt,
        query_counts=q,
    )
    return out.token_rewards


def fast_discovery(ground_truths, docs):
    return discover_entities(ground_truths, docs, num_steps=max(len(d) for d in docs))


# ----------------------------------------------------------------------------- timing


def timed(fn, repeats):
    """Median wall time of ``repeats`` calls, all times, the last result and the 1-min load average
    before and after (``os.getloadavg()``)."""
    times, result = [], None
    load_before = os.getloadavg()[0]
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result, (load_before, os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of the vectorised code (median)")
    parser.add_argument("--loop-repeats", type=int, default=3, help="runs of the loop baselines (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: fair to the single-threaded loops)"
    )
    parser.add_argument("--pool", type=int, default=150, help="distinct passages per prompt (see above)")
    parser.add_argument("--distinct-docs", action="store_true", help="every retrieval a new passage")
    args = smoke.parse_args(parser, repeats=1, loop_repeats=1, pool=20)
    if args.smoke:  # 2 prompts x 4 rollouts of 4,096 tokens
        global PROMPTS, GROUP, LENGTH
        PROMPTS, GROUP, LENGTH = 2, 4, 4096
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    index, gts, mask, docs, counts, rewards, f1, ok = make_batch(
        args.seed, None if args.distinct_docs else args.pool
    )
    retrieved = [doc for d in docs for step in d for doc in step]
    n_words = sum(len(t.split()) for t in retrieved)
    print(
        f"batch: {mask.shape[0]}×{mask.shape[1]} tokens, {mask.sum().item() / mask.shape[0]:.0f} model tokens/row, "
        f"{sum(len(d) for d in docs) / len(docs):.1f} steps/row, {len(retrieved)} retrieved passages "
        f"({len(set(retrieved))} distinct), {n_words / 1e6:.2f}M document words "
        f"(built in {time.perf_counter() - t0:.1f}s); torch threads={torch.get_num_threads()}"
    )
    cfg = SpaderRewardConfig()
    rows = []

    fast_t, fast_all, fast_adv, fl = timed(lambda: spa_advantage(rewards, mask, index)[0], args.repeats)
    loop_t, loop_all, loop_adv, ll = timed(lambda: loop_spa(rewards, mask, list(index)), args.loop_repeats)
    diff = (fast_adv - loop_adv).abs().max().item()
    rows.append(("SPA advantage", fast_t, loop_t, diff, fast_all, loop_all, fl, ll))

    fast_t, fast_all, fast_r, fl = timed(
        lambda: fast_reward(mask, index, gts, docs, counts, f1, ok, cfg), args.repeats
    )
    loop_t, loop_all, loop_r, ll = timed(
        lambda: loop_reward(mask, list(index), gts, docs, counts, f1, ok, cfg), args.loop_repeats
    )
    rows.append(
        (
            "SPADER reward (full)",
            fast_t,
            loop_t,
            (fast_r - loop_r).abs().max().item(),
            fast_all,
            loop_all,
            fl,
            ll,
        )
    )

    fast_t, fast_all, (found, _), fl = timed(lambda: fast_discovery(gts, docs), args.repeats)
    loop_t, loop_all, loop_found, ll = timed(lambda: loop_discovery(gts, docs), args.loop_repeats)
    same = all(
        set(np.flatnonzero(found[i, s].numpy()).tolist()) == loop_found[i][1][s]
        for i in range(len(docs))
        for s in range(len(docs[i]))
    )
    rows.append(
        ("  discovery only", fast_t, loop_t, 0.0 if same else float("inf"), fast_all, loop_all, fl, ll)
    )

    print(
        f"{'':24s}{'vectorised (s)':>16s}{'loops (s)':>12s}{'speed-up':>10s}{'max|diff|':>12s}   load (1-min) ours / loops"
    )
    for name, fast, loop, diff, _, _, fl, ll in rows:
        print(
            f"{name:24s}{fast:16.3f}{loop:12.2f}{loop / fast:9.1f}×{diff:12.2e}"
            f"   {fl[0]:.1f}→{fl[1]:.1f} / {ll[0]:.1f}→{ll[1]:.1f}"
        )
    print("all runs (s):")
    for name, _, _, _, fast_all, loop_all, _, _ in rows:
        print(
            f"  {name.strip()}: vectorised {[round(x, 3) for x in fast_all]}, loops {[round(x, 2) for x in loop_all]}"
        )
    worst = max(r[3] for r in rows)
    if worst > 1e-5:
        raise SystemExit(f"results differ: max |diff| = {worst}")


if __name__ == "__main__":
    main()
