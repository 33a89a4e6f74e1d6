"""The multi-turn loop against a real retrieval server: scripted policy, loop limits, corrective
observations, failure handling, and the token layout of the in-process HF backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from agent_toy_data import GROUPS, QUESTIONS

from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.protocol import FORMAT_HINT, format_error_observation
from spader_pipeline.agent.rollout import run_rollouts, run_rollouts_sync
from spader_pipeline.agent.scripted import ScriptedPolicy, evidence_line, question_query
from spader_pipeline.agent.search_step import observe_search
from spader_pipeline.agent.types import GeneratedTurn, Generator, RolloutConfig, SamplingParams
from spader_pipeline.retrieval import RetrievalClient

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = resolve_template(yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"])


class Replay(Generator):
    """Plays fixed assistant turns (a stand-in for a model whose output we choose)."""

    def __init__(self, turns):
        self.turns = list(turns)

    async def generate(self, states):
        return [
            GeneratedTurn(text=self.turns[min(len(s.steps), len(self.turns) - 1)])
            if not isinstance(self.turns[0], Exception)
            else GeneratedTurn(text="", error="boom")
            for s in states
        ]


async def _roll(samples, generator, url, config=None, **client_kwargs):
    async with RetrievalClient(url, **client_kwargs) as client:
        return await run_rollouts(samples, generator, client, config or RolloutConfig(), TEMPLATE)


def test_scripted_policy_finds_the_group_through_the_server(retrieval_url):
    trajectories = asyncio.run(_roll(QUESTIONS, ScriptedPolicy(), retrieval_url, RolloutConfig(topk=4)))
    west, plays, birds = trajectories
    assert west.finish_reason == "answer"
    assert set(west.predicted) == set(GROUPS["Country in West Africa"])
    assert set(plays.predicted) == set(GROUPS["Play by William Shakespeare"])
    assert set(birds.predicted) == set(GROUPS["Family of birds"])
    # two searches: the question's content words, then the evidence line itself
    assert west.num_searches == 2
    assert west.steps[0].queries == ("countries West Africa",)
    assert west.steps[1].queries == ("Country in West Africa",)
    assert birds.steps[0].queries == ("Family of birds",)  # quoted phrase used verbatim
    step = west.steps[0]
    assert len(step.doc_ids) == 1 and len(step.doc_ids[0]) == 4
    assert all(i.startswith("p") for i in step.doc_ids[0])
    assert len(step.retrieved_texts) == 4 and step.retrieved_texts[0].split("\n")[0] in step.titles[0]
    assert step.observation.startswith("<tool_response>\nResults for query 1:\nDoc 1 (Title: ")
    # the chat history alternates and ends with the answer turn
    roles = [m["role"] for m in west.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
    record = west.to_record()
    assert record["predicted"] == list(west.predicted) and record["response_ids"] is None


def test_invalid_turns_get_a_corrective_observation_and_max_turns_stops(retrieval_url):
    [t] = asyncio.run(
        _roll(QUESTIONS[:1], Replay(["I am not sure."]), retrieval_url, RolloutConfig(max_turns=3))
    )
    assert t.finish_reason == "max_turns" and t.predicted is None
    assert [s.kind for s in t.steps] == ["invalid"] * 3
    assert [s.error_kind for s in t.steps] == ["invalid_turn"] * 3
    assert t.steps[0].observation == format_error_observation(t.steps[0].error)
    assert FORMAT_HINT in t.messages[2]["content"]
    assert t.steps[-1].observation is None  # nothing is observed after the last allowed turn
    assert t.num_searches == 0 and t.num_invalid_turns == 3


def test_tool_call_in_last_turn_is_not_executed(retrieval_url):
    [t] = asyncio.run(
        _roll(
            QUESTIONS[:1],
            Replay(['<tool_call>["Ghana"]</tool_call>']),
            retrieval_url,
            RolloutConfig(max_turns=2),
        )
    )
    assert t.finish_reason == "max_turns"
    assert t.steps[0].doc_ids and not t.steps[1].doc_ids
    assert t.num_searches == 1


def test_too_many_queries_are_capped_and_the_observation_says_so(retrieval_url):
    turns = ['<tool_call>["Ghana", "Togo", "Mali"]</tool_call>', '<answer>["Ghana"]</answer>']
    config = RolloutConfig(max_queries_per_call=2, topk=1, max_observation_chars=2000)
    [t] = asyncio.run(_roll(QUESTIONS[:1], Replay(turns), retrieval_url, config))
    step = t.steps[0]
    assert step.queries == ("Ghana", "Togo") and len(step.doc_ids) == 2
    assert "Only the first 2 of 3 queries were run." in step.observation
    assert "Results for query 3" not in step.observation


def test_search_failure_becomes_an_error_observation():
    # nothing listens on this port: the client gives up and the agent reads an error, nothing raises
    turns = ['<tool_call>["Ghana"]</tool_call>', '<answer>["Ghana"]</answer>']
    [t] = asyncio.run(_roll(QUESTIONS[:1], Replay(turns), "http://127.0.0.1:9", max_retries=0, timeout=2.0))
    assert t.finish_reason == "answer" and t.predicted == ("Ghana",)
    assert t.steps[0].error_kind == "search_failed" and t.num_searches == 0
    assert t.steps[0].observation.startswith("<tool_response>\nError: the search service failed")


class _Uninstalled:
    async def search(self, queries, topk=5, max_chars=None):
        raise ModuleNotFoundError("No module named 'scipy'")  # what bm25s' import raised on a bare GPU machine


def test_a_search_that_cannot_run_raises_where_a_failed_one_is_an_observation():
    """A missing module is a broken installation: every search would fail alike, so it stops the run."""
    with pytest.raises(ModuleNotFoundError, match="scipy"):
        asyncio.run(observe_search(_Uninstalled(), ["Ghana"], RolloutConfig()))


def test_a_refused_query_is_the_agents_error_not_an_outage(retrieval_url):
    turns = ['<tool_call>["' + "x" * 5000 + '"]</tool_call>', '<answer>["Ghana"]</answer>']
    [t] = asyncio.run(_roll(QUESTIONS[:1], Replay(turns), retrieval_url))
    assert t.steps[0].error_kind == "query_rejected" and t.finish_reason == "answer"
    assert "rejected these queries (4" in t.steps[0].observation


def test_generator_error_ends_the_trajectory(retrieval_url):
    [t] = asyncio.run(_roll(QUESTIONS[:1], Replay([RuntimeError()]), retrieval_url))
    assert t.finish_reason == "error" and t.error == "boom" and t.steps == []


def test_scripted_helpers():
    assert (
        question_query("Which plays were written by William Shakespeare?")
        == "plays written William Shakespeare"
    )
    assert question_query('Which articles have the short description "Family of birds"?') == "Family of birds"
    assert evidence_line("Country in West Africa. Ghana is ...") == "Country in West Africa"
    assert evidence_line("Country in West Africa\nGhana is ...") == "Country in West Africa"


def test_config_from_mapping_rejects_unknown_keys():
    assert RolloutConfig.from_mapping({"max_turns": 2}).max_turns == 2
    with pytest.raises(ValueError, match=r"unknown rollout settings \['max_turn'\]"):
        RolloutConfig.from_mapping({"max_turn": 2})
    with pytest.raises(ValueError, match="unknown sampling settings"):
        SamplingParams.from_mapping({"temp": 1})


# ---- in-process Hugging Face backend: VERL's token layout ---------------------------------------


def _segments(mask):
    """[(value, start, end)] runs of the response mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_hf_rollout_token_layout_matches_verl(tiny_lm, retrieval_url):
    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.tokens import pad_batch

    model, tokenizer = tiny_lm
    config = RolloutConfig(max_turns=3, max_response_tokens=1500, topk=2)
    gen = HFGenerator(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=12, seed=0))
    trajectories = asyncio.run(_roll(QUESTIONS[:2], gen, retrieval_url, config))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer.encode("\n", add_special_tokens=False)
    for t in trajectories:
        assert t.prompt_ids == list(
            tokenizer.apply_chat_template(
                t.messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        assert len(t.response_ids) == len(t.response_mask) <= config.max_response_tokens
        model_runs = [(s, e) for v, s, e in _segments(t.response_mask) if v == 1]
        assert model_runs == [s.token_span for s in t.steps if s.token_span[1] > s.token_span[0]]
        for step in t.steps:
            start, end = step.token_span
            assert tokenizer.decode(t.response_ids[start:end], skip_special_tokens=True) == step.text
        # each observation segment = the user message rendered alone with the generation prompt
        # (no system prefix in this template), after the newline Qwen's template puts after <|im_end|>
        observations = [m for m in t.messages[1:] if m["role"] == "user"]
        obs_runs = [(s, e) for v, s, e in _segments(t.response_mask) if v == 0]
        assert len(obs_runs) == len(observations)
        for (s, e), message in zip(obs_runs, observations, strict=True):
            expected = list(
                tokenizer.apply_chat_template(
                    [message], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            if t.response_ids[s - 1] == im_end:
                expected = newline + expected
            assert t.response_ids[s:e] == expected
    batch = pad_batch(trajectories, tokenizer.pad_token_id)
    b, r = batch["responses"].shape
    assert b == 2 and batch["attention_mask"].shape == (2, batch["prompts"].shape[1] + r)
    assert int(batch["response_mask"].sum()) == sum(sum(t.response_mask) for t in trajectories)


def test_hf_token_budget_is_never_exceeded(tiny_lm, retrieval_url):
    from spader_pipeline.agent.hf_backend import HFGenerator

    model, tokenizer = tiny_lm
    config = RolloutConfig(max_turns=8, max_response_tokens=60, topk=2)
    gen = HFGenerator(model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=25))
    [t] = asyncio.run(_roll(QUESTIONS[:1], gen, retrieval_url, config))
    assert t.finish_reason in ("token_budget", "answer", "max_turns")
    assert len(t.response_ids) <= 60


def test_scripted_demonstrations_encode_like_rollouts(tiny_lm, retrieval_url):
    from spader_pipeline.agent.hf_backend import encode_dialogue

    _, tokenizer = tiny_lm
    [t] = asyncio.run(_roll(QUESTIONS[:1], ScriptedPolicy(), retrieval_url))
    prompt_ids, response_ids, mask = encode_dialogue(t.messages, tokenizer, model_type="qwen3")
    assert prompt_ids == list(
        tokenizer.apply_chat_template(
            t.messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    runs = [(s, e) for v, s, e in _segments(mask) if v == 1]
    texts = [tokenizer.decode(response_ids[s:e], skip_special_tokens=True) for s, e in runs]
    assert texts == [m["content"] for m in t.messages if m["role"] == "assistant"]


def test_run_rollouts_sync_works_from_plain_code(retrieval_url):
    client = RetrievalClient(retrieval_url)
    [t] = run_rollouts_sync(QUESTIONS[:1], ScriptedPolicy(), client, RolloutConfig(), TEMPLATE)
    assert t.finish_reason == "answer"


def test_hf_kv_cache_reuse_gives_the_same_turns(tiny_lm):
    """Continuing from the KV cache (variable-length observations, trajectories dropping out)
    samples exactly what re-encoding the whole context samples."""
    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.types import RolloutState

    model, tokenizer = tiny_lm
    sampling = SamplingParams(temperature=0.0, max_new_tokens=9)
    cached, fresh = (
        HFGenerator(model, tokenizer, sampling),
        HFGenerator(model, tokenizer, sampling, reuse_kv_cache=False),
    )
    prompts = [tokenizer.encode(q["question"]) for q in QUESTIONS] + [tokenizer.encode("Ghana")]
    states = {
        name: [
            RolloutState(sample={}, messages=[], token_ids=list(p), uid=f"t{i}")
            for i, p in enumerate(prompts)
        ]
        for name in ("cached", "fresh")
    }
    observation = tokenizer.encode("Doc 1 (Title: Ghana) Country in West Africa. Accra is the capital.")
    for round_ in range(4):
        turns = {
            "cached": asyncio.run(cached.generate(states["cached"])),
            "fresh": asyncio.run(fresh.generate(states["fresh"])),
        }
        assert [t.token_ids for t in turns["cached"]] == [t.token_ids for t in turns["fresh"]]
        for name in states:
            for i, (state, turn) in enumerate(zip(states[name], turns[name], strict=True)):
                state.token_ids += list(turn.token_ids) + observation[: 3 + 7 * i + round_]
            if round_ == 1:  # trajectories finish: the batch shrinks to a subset
                states[name] = [states[name][0], states[name][2], states[name][3]]
    assert cached.kv_reuses == 3 and fresh.kv_reuses == 0


def test_hf_shared_prompt_prefill_gives_the_same_turns(tiny_lm):
    """A group's shared prompt is encoded once and its cache copied to every row of the group
    (left-padded prompts of different lengths); the turns equal encoding every row separately."""
    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.types import RolloutState

    model, tokenizer = tiny_lm
    sampling = SamplingParams(temperature=0.0, max_new_tokens=9)
    shared, separate = (
        HFGenerator(model, tokenizer, sampling),
        HFGenerator(model, tokenizer, sampling, reuse_kv_cache=False),
    )
    prompts = [tokenizer.encode(q["question"]) for q in QUESTIONS[:2]] + [tokenizer.encode("Ghana")]
    group = [p for p in prompts for _ in range(3)]  # 3 prompts x 3 rows

    def states():
        return [RolloutState(sample={}, messages=[], token_ids=list(p), uid=f"t{i}") for i, p in enumerate(group)]

    turns = asyncio.run(shared.generate(states()))
    assert shared.shared_prefills == 1
    assert [t.token_ids for t in turns] == [t.token_ids for t in asyncio.run(separate.generate(states()))]


@pytest.mark.parametrize("group_size", [1, 3])
def test_hf_common_instruction_prefix_is_encoded_once(tiny_lm, group_size):
    """Distinct questions behind the same instruction (an evaluation batch; with groups, an RL
    step): the instruction is encoded once for the batch, and the turns, and the next turn's
    cache continuation, equal encoding every row separately."""
    from spader_pipeline.agent.hf_backend import HFGenerator
    from spader_pipeline.agent.types import RolloutState

    model, tokenizer = tiny_lm
    sampling = SamplingParams(temperature=0.0, max_new_tokens=7)
    shared, separate = (
        HFGenerator(model, tokenizer, sampling),
        HFGenerator(model, tokenizer, sampling, reuse_kv_cache=False),
    )
    instruction = "Find every correct answer to the question by searching a Wikipedia index. Question: "
    prompts = [tokenizer.encode(instruction + q["question"]) for q in QUESTIONS[:3]]
    prefix = len(tokenizer.encode(instruction)) - 1  # the question's first token may merge with the space
    observation = tokenizer.encode(" Doc 1 (Title: Ghana) Country in West Africa.")
    runs = {}
    for name, gen in (("shared", shared), ("separate", separate)):
        states = [RolloutState(sample={}, messages=[], token_ids=list(p), uid=f"t{i}")
                  for i, p in enumerate(p for p in prompts for _ in range(group_size))]
        first = asyncio.run(gen.generate(states))
        for i, (state, turn) in enumerate(zip(states, first, strict=True)):
            state.token_ids += list(turn.token_ids) + observation[: 4 + i]
        runs[name] = [t.token_ids for t in first] + [t.token_ids for t in asyncio.run(gen.generate(states))]
    assert runs["shared"] == runs["separate"]
    assert shared.shared_prefix_tokens >= prefix * (len(prompts) * group_size - 1)
    assert shared.kv_reuses == 1 and separate.shared_prefix_tokens == 0
