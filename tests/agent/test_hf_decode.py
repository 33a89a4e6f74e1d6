"""decode_batch (finished rows leave the batch) against ``model.generate``: the same greedy turns,
cache continuation over several turns (the cache's masked gaps closed), the same sampling
distribution, and the fallback."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from agent_toy_data import QUESTIONS

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.types import RolloutState, SamplingParams
from spader_pipeline.modeling import kv_cache


def _states(prompts, limits):
    """One state per prompt; ``limits``: each row's whole-response token budget."""
    return [
        RolloutState(sample={}, messages=[], token_ids=list(p), prompt_length=len(p), max_response_tokens=m,
                     uid=f"t{i}")
        for i, (p, m) in enumerate(zip(prompts, limits, strict=True))
    ]


def _frequent_tokens(model, tokenizer, prompts, count):
    """Tokens a greedy turn of the tiny model often emits: made end-of-turn tokens, rows end at
    different steps (a random model rarely samples its real end-of-sequence token)."""
    gen = HFGenerator(model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=12), drop_finished_rows=False)
    turns = asyncio.run(gen.generate(_states(prompts, [100] * len(prompts))))
    seen: dict[int, int] = {}
    for turn in turns:
        for token in turn.token_ids[1:]:
            seen[token] = seen.get(token, 0) + 1
    return {t for t, _ in sorted(seen.items(), key=lambda kv: -kv[1])[:count]}


@pytest.mark.parametrize("row_by_row", [True, False], ids=["rows-row-by-row", "rows-in-one-copy"])
@pytest.mark.parametrize(("rows", "stops", "shared_prefix", "blocks"),
                         [(5, 1, False, None), (6, 2, True, None), (3, 0, False, None), (6, 2, True, (0, 0))])
def test_greedy_turns_equal_generate_across_turns(tiny_lm, rows, stops, shared_prefix, blocks, row_by_row,
                                                  monkeypatch):
    """Rows of different lengths, ending at different steps (stop tokens, per-row budgets), three
    turns with cache continuation and a batch that shrinks: token ids equal ``generate``'s, and
    no finished row is decoded. ``blocks``: the observations' prefill in blocks of rows (``(0, 0)``:
    a block per distinct length). The cache reorders its rows and closes its gaps a row at a time (a
    CPU's way) or in one copy per buffer (a GPU's, :data:`~spader_pipeline.modeling.kv_cache.ROW_BY_ROW_DEVICES`)."""
    if not row_by_row:
        monkeypatch.setattr(kv_cache, "ROW_BY_ROW_DEVICES", frozenset())
    model, tokenizer = tiny_lm
    head = "Find every answer. Question: " if shared_prefix else ""
    texts = [head + q["question"] for q in QUESTIONS] + [head + t for t in ("Ghana", "Which river?", "Accra", "Lakes")]
    prompts = [tokenizer.encode(t) for t in texts[:rows]]
    limits = [40, 13, 9, 40, 22, 30][:rows]
    stop = _frequent_tokens(model, tokenizer, prompts, stops)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    gens = {"new": HFGenerator(model, tokenizer, sampling, prefill_block_cost=blocks),
            "old": HFGenerator(model, tokenizer, sampling, drop_finished_rows=False)}
    assert gens["new"].drop_finished_rows
    observation = tokenizer.encode(" Doc 1 (Title: Ghana) Country in West Africa. Accra is the capital.")
    states = {name: _states(prompts, limits) for name in gens}
    for gen in gens.values():
        gen.eos_ids |= stop
    for round_ in range(3):
        turns = {name: asyncio.run(gen.generate(states[name])) for name, gen in gens.items()}
        assert [t.token_ids for t in turns["new"]] == [t.token_ids for t in turns["old"]]
        assert [t.text for t in turns["new"]] == [t.text for t in turns["old"]]
        lengths = {len(t.token_ids) for t in turns["new"]}
        for name in gens:
            for i, (state, turn) in enumerate(zip(states[name], turns[name], strict=True)):
                state.token_ids += list(turn.token_ids) + observation[: 2 + 3 * i + round_]
            if round_ == 0 and rows > 3:  # trajectories finish: the batch shrinks to a subset
                states[name] = [s for i, s in enumerate(states[name]) if i != 1]
    assert gens["new"].kv_reuses == gens["old"].kv_reuses == 2
    assert gens["new"].gap_compactions == 2 and gens["old"].gap_compactions == 0  # gaps closed each turn
    assert gens["new"].blocked_prefills == (2 if blocks else 0)
    assert gens["new"].generated_tokens == gens["old"].generated_tokens
    # the new loop samples exactly the generated tokens; generate samples padding too when rows differ
    assert gens["new"].sampled_rows == gens["new"].generated_tokens <= gens["old"].sampled_rows
    assert len(lengths) > 1  # rows did end at different steps


def test_sampled_turns_do_not_depend_on_prefill_blocks(tiny_lm):
    """Seeded sampling over three turns whose observations differ in length per row: the prefill in
    blocks (rows reordered by length) draws the same tokens as one forward, because each row's
    uniform numbers follow the input row, not its place in the cache."""
    model, tokenizer = tiny_lm
    prompts = [tokenizer.encode(t) for t in [q["question"] for q in QUESTIONS] + ["Ghana", "Which river?"]][:4]
    observation = tokenizer.encode(" Doc 1 (Title: Ghana) Country in West Africa. Accra is the capital.")
    sampling = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8, seed=5)
    gens = {"blocks": HFGenerator(model, tokenizer, sampling, prefill_block_cost=(0, 0)),
            "one": HFGenerator(model, tokenizer, sampling, prefill_block_cost=None)}
    states = {name: _states(prompts, [60] * 4) for name in gens}
    for round_ in range(3):
        turns = {name: asyncio.run(gen.generate(states[name])) for name, gen in gens.items()}
        assert [t.token_ids for t in turns["blocks"]] == [t.token_ids for t in turns["one"]]
        for name in gens:
            for i, (state, turn) in enumerate(zip(states[name], turns[name], strict=True)):
                state.token_ids += list(turn.token_ids) + observation[: 1 + 4 * i + round_]
    assert gens["blocks"].blocked_prefills == 2 and gens["one"].blocked_prefills == 0


def test_sampling_draws_from_the_same_distribution(tiny_lm):
    """temperature/top-p/top-k sampling: the first token's empirical distribution over many rows
    of one prompt matches ``generate``'s (same processors), and per-row budgets are kept."""
    model, tokenizer = tiny_lm
    prompt = tokenizer.encode(QUESTIONS[0]["question"])
    sampling = SamplingParams(temperature=1.3, top_p=0.9, top_k=20, max_new_tokens=3, seed=0)
    counts = {}
    for name, flag in (("new", True), ("old", False)):
        gen = HFGenerator(model, tokenizer, sampling, drop_finished_rows=flag, micro_batch_size=1600)
        turns = asyncio.run(gen.generate(_states([prompt] * 1600, [2 + i % 2 for i in range(1600)])))
        assert all(len(t.token_ids) <= 2 + i % 2 for i, t in enumerate(turns))
        counts[name] = torch.bincount(torch.tensor([t.token_ids[0] for t in turns]), minlength=len(tokenizer))
    new, old = counts["new"].float() / 1600, counts["old"].float() / 1600
    assert (new > 0).sum() > 5  # a spread distribution, not a point mass
    assert (new - old).abs().sum() / 2 < 0.12  # total variation of two 1600-draw samples (~0.06 expected)


def test_unsupported_cache_falls_back_to_generate(tiny_lm, caplog):
    model, tokenizer = tiny_lm
    with caplog.at_level(logging.INFO, logger="spader_pipeline.agent.decode_engine"):
        gen = HFGenerator(model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=5), growing_kv_cache=False)
    assert not gen.drop_finished_rows
    assert "decoding with model.generate" in caplog.text
    prompts = [tokenizer.encode(q["question"]) for q in QUESTIONS[:2]]
    assert len(asyncio.run(gen.generate(_states(prompts, [50, 50])))) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_static_step_gives_the_host_loops_turns_and_states(tiny_lm, temperature, monkeypatch):
    """The GPU's decoding steps (modeling/graph_decode.py), forced on this CPU, under bf16 autocast: over three
    turns whose batch shrinks, with a shared prefix, prefills in blocks and rows ending on stop tokens, the
    host loop's tokens, log-probabilities and boundary states, the same floats (a grouped-query model on
    ``sdpa_gqa``, whose decoding the CPU attends in fp32 either way)."""
    from spader_pipeline.modeling import static_cache
    from spader_pipeline.modeling.attention import use_gqa_attention
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_tiny_qwen3
    from spader_pipeline.modeling.graph_decode import static_decode_stats

    _, tokenizer = tiny_lm
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64)
    model = build_tiny_qwen3(tokenizer, spec, seed=0)
    assert use_gqa_attention(model)
    texts = ["Find every answer. Question: " + t for t in [q["question"] for q in QUESTIONS] + ["Ghana", "Which river?"]]
    prompts = [tokenizer.encode(t) for t in texts[:4]]
    observation = tokenizer.encode(" Doc 1 (Title: Ghana) Country in West Africa. Accra is the capital.")
    stop = _frequent_tokens(model, tokenizer, prompts, 2)
    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, max_new_tokens=9, seed=3)

    def roll(static: bool):
        monkeypatch.setattr(static_cache, "STATIC_DECODE", "on" if static else "off")
        gen = HFGenerator(model, tokenizer, sampling, prefill_block_cost=(0, 0), capture_states_from_layer=0,
                          return_log_probs=True, bf16=True)
        gen.eos_ids |= stop
        states = _states(prompts, [40, 14, 40, 30])
        for state in states:
            gen.start(state)
        turns = []
        for round_ in range(3):
            out = asyncio.run(gen.generate(states))
            turns.append([(t.token_ids, t.logprobs) for t in out])
            for i, (state, turn) in enumerate(zip(states, out, strict=True)):
                state.token_ids += list(turn.token_ids) + observation[: 1 + 3 * i + round_]
            if round_ == 0:
                states = [s for i, s in enumerate(states) if i != 1]
        return turns, [(c.token_ids.tolist(), c.states) for c in gen.captured_states()], gen

    host, host_states, _ = roll(False)
    steps = static_decode_stats()["eager_steps"]
    static, static_states, gen = roll(True)
    assert static_decode_stats()["eager_steps"] > steps  # the static step decoded
    assert static == host  # ==: tokens and log-probabilities
    assert gen.blocked_prefills == 2 and gen.kv_reuses == 2
    assert len({len(ids) for turn in host for ids, _ in turn}) > 1  # rows ended at different steps
    for (ids, states), (host_ids, host_state) in zip(static_states, host_states, strict=True):
        assert ids == host_ids and torch.equal(states, host_state)
