"""The VERL search tool and agent loop on CPU: a real retrieval server on 127.0.0.1, a tiny real
Qwen3 behind a fake ``server_manager.generate`` (VERL's GPU rollout server is the only stand-in).

The key check: VERL's loop and the project's in-process HF rollout produce *identical* prompt ids,
response ids, response masks and observation text for the same model and greedy decoding."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from spader_pipeline.agent.hf_backend import HFGenerator  # noqa: E402
from spader_pipeline.agent.protocol import format_error_observation  # noqa: E402
from spader_pipeline.agent.rollout import run_rollouts
from spader_pipeline.agent.types import RolloutConfig, SamplingParams  # noqa: E402
from spader_pipeline.retrieval import RetrievalClient, build_index_from_file, running_service  # noqa: E402
from spader_pipeline.verl_plugin.agent_loop import AGENT_NAME, SearchAgentLoop  # noqa: E402
from spader_pipeline.verl_plugin.search_tool import SearchTool  # noqa: E402

DOCS = [
    ("Ghana", "Country in West Africa. Accra is the capital of Ghana."),
    ("Togo", "Country in West Africa. Lome is the capital of Togo."),
    ("Kenya", "Country in East Africa. Nairobi is the capital of Kenya."),
    ("Hamlet", "Play by William Shakespeare. A prince of Denmark."),
]
PROMPT = [
    {
        "role": "user",
        "content": "Answer with <tool_call>[...]</tool_call> or <answer>[...]</answer>.\n\nQuestion: Which countries are in West Africa?",
    }
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def search_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-search")
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": str(i), "title": t, "contents": c}) + "\n" for i, (t, c) in enumerate(DOCS))
    )
    build_index_from_file(corpus, root / "bm25", "bm25")
    with running_service(root / "bm25") as url:
        yield url


@pytest.fixture(scope="module")
def lm():
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_tiny_qwen3
    from spader_pipeline.modeling.tokenizer import train_tokenizer

    texts = [c for _, c in DOCS] + [
        PROMPT[0]["content"],
        '<tool_call>["Ghana"]</tool_call><answer>["Togo"]</answer>',
    ] * 3
    tokenizer = train_tokenizer(texts, vocab_size=500, min_frequency=1)
    spec = TinyQwen3Spec(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    return build_tiny_qwen3(tokenizer, spec, seed=1), tokenizer


class FakeServer:
    """Stands in for VERL's rollout server: greedy continuation of ``prompt_ids`` by the tiny model."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.calls = 0
        self.max_new_tokens: list[int | None] = []  # what each request asked for

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        self.calls += 1
        self.max_new_tokens.append(sampling_params.get("max_new_tokens"))
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=min(MAX_NEW, sampling_params.get("max_new_tokens") or MAX_NEW),
                do_sample=False,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        ids = out[0, len(prompt_ids) :].tolist()
        if self.tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(self.tokenizer.eos_token_id) + 1]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


def _tool(url, **config):
    return SearchTool({"type": "native", "retrieval_service_url": url, "topk": 2, **config}, None)


def _loop(lm, url, *, turns=3, response_length=600, custom=None, **tool_config):
    model, tokenizer = lm
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": 256,
                    "response_length": response_length,
                    "custom": custom,
                    "multi_turn": {"max_assistant_turns": turns, "max_tool_response_length": 11000},
                }
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )
    return SearchAgentLoop(
        trainer_config=DictConfigWrap(config),
        server_manager=FakeServer(model, tokenizer),
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
        hf_model_type="qwen3",
        tools=ToolListWrap([_tool(url, **tool_config)]),
    )


def test_tool_returns_the_shared_observation_format(search_url):
    async def go():
        tool = _tool(search_url)
        instance, _ = await tool.create()
        ok = await tool.execute(instance, {"query_list": ["West Africa country", ""]})
        empty = await tool.execute(instance, {"query_list": []})
        bad = await _tool("http://127.0.0.1:9", max_retries=0).execute(instance, {"query_list": ["x"]})
        await tool.release(instance)
        return ok, empty, bad

    (ok, reward, metrics), (empty, _, empty_metrics), (bad, _, bad_metrics) = asyncio.run(go())
    assert ok.text.startswith("<tool_response>\nResults for query 1:\nDoc 1 (Title: ")
    assert "Results for query 2" not in ok.text  # the empty query was dropped
    assert reward == 0.0 and metrics["num_queries"] == 1 and len(metrics["doc_ids"][0]) == 2
    assert empty.text == format_error_observation("the tool call has no non-empty query")
    assert "error" in empty_metrics
    assert bad.text.startswith("<tool_response>\nError: the search service failed") and "error" in bad_metrics


def test_agent_loop_is_registered():
    import spader_pipeline.verl_plugin  # noqa: F401  (the package import registers it)

    assert _agent_loop_registry[AGENT_NAME]["_target_"].endswith("agent_loop.SearchAgentLoop")


def test_agent_loop_matches_the_project_rollout_token_for_token(lm, search_url):
    model, tokenizer = lm
    loop = _loop(lm, search_url)
    output = asyncio.run(
        loop.run({"temperature": 0.0}, raw_prompt=PROMPT, extra_info={"id": "q", "question": "x"})
    )

    async def ours():
        gen = HFGenerator(
            model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), max_prompt_tokens=256
        )
        config = RolloutConfig(max_turns=3, max_response_tokens=600, topk=2)
        async with RetrievalClient(search_url) as client:
            [t] = await run_rollouts(
                [{"id": "q", "question": "x", "messages": PROMPT}], gen, client, config, None
            )
        return t

    t = asyncio.run(ours())
    assert output.prompt_ids == t.prompt_ids
    assert output.response_ids == t.response_ids
    assert output.response_mask == t.response_mask
    assert 0 in output.response_mask and 1 in output.response_mask
    # log-probs: the server's for model tokens, 0.0 for observation tokens
    assert len(output.response_logprobs) == len(output.response_ids)
    assert all(
        (lp == -0.5) == (m == 1) for lp, m in zip(output.response_logprobs, output.response_mask, strict=True)
    )
    assert output.num_turns == len(t.steps) + sum(s.observation is not None for s in t.steps) + 1
    assert output.extra_fields["finish_reason"] == t.finish_reason
    assert loop.server_manager.calls == len(t.steps)


def test_agent_loop_respects_the_response_budget(lm, search_url):
    loop = _loop(lm, search_url, turns=10, response_length=40)
    output = asyncio.run(loop.run({}, raw_prompt=PROMPT, extra_info={}))
    assert len(output.response_ids) == len(output.response_mask) <= 40


def test_a_turn_asks_for_at_most_the_turn_cap_within_the_response_budget(lm, search_url):
    """``rollout.custom.max_turn_tokens`` (the native trainer's ``max_new_tokens``) caps each request;
    without it the request leaves the budget to the server's own rule."""
    loop = _loop(lm, search_url, turns=10, response_length=40, custom={"max_turn_tokens": 7})
    output = asyncio.run(loop.run({}, raw_prompt=PROMPT, extra_info={}))
    asked = loop.server_manager.max_new_tokens
    assert asked and all(1 <= n <= 7 for n in asked)
    assert len(output.response_ids) <= 40
    uncapped = _loop(lm, search_url, turns=2)
    asyncio.run(uncapped.run({}, raw_prompt=PROMPT, extra_info={}))
    assert set(uncapped.server_manager.max_new_tokens) == {None}


def test_agent_loop_requires_the_search_tool(lm):
    model, tokenizer = lm
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"prompt_length": 8, "response_length": 8, "multi_turn": {}}},
            "data": {},
        }
    )
    with pytest.raises(ValueError, match="SearchTool"):
        SearchAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=None,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(config.data),
            hf_model_type="qwen3",
            tools=ToolListWrap([]),
        )


class ScriptedServer:
    """A 'model' that searches once, then answers: token ids of fixed turns, ending in <|im_end|>."""

    TURNS = (
        '<think>look</think><tool_call>["West Africa country"]</tool_call>',
        '<answer>["Ghana", "Togo"]</answer>',
    )

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        text = self.TURNS[min(self.calls, 1)]
        self.calls += 1
        return TokenOutput(
            token_ids=self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        )


@pytest.mark.parametrize("tool_config", [{}, {"max_document_chars": 30}], ids=["whole passages", "passages cut"])
def test_search_observation_in_verl_equals_the_rollout_observation(lm, search_url, tool_config):
    """Every search setting of the tool reaches the loop: with each passage cut (the native trainer's
    ``rollout.max_document_chars``) verl's observation is still the native rollout's, token for token."""
    from spader_pipeline.agent.types import GeneratedTurn, Generator

    _, tokenizer = lm
    loop = _loop(lm, search_url, **tool_config)
    loop.server_manager = ScriptedServer(tokenizer)
    output = asyncio.run(loop.run({}, raw_prompt=PROMPT, extra_info={}))
    assert output.extra_fields["finish_reason"] == "answer"
    assert output.extra_fields["search_queries"] == [["West Africa country"], []]
    observed = [i for i, m in zip(output.response_ids, output.response_mask, strict=True) if m == 0]

    class Replay(Generator):
        async def generate(self, states):
            return [GeneratedTurn(text=ScriptedServer.TURNS[len(s.steps)]) for s in states]

    async def ours():
        async with RetrievalClient(search_url) as client:
            return await run_rollouts([{"messages": PROMPT}], Replay(), client, RolloutConfig(topk=2, **tool_config),
                                      None)

    [t] = asyncio.run(ours())
    observation = t.messages[2]["content"]
    assert observation.startswith("<tool_response>\nResults for query 1:\nDoc 1 (Title: ")
    assert ("…" in observation) == bool(tool_config)  # the passages were cut where the tool says so
    expected = tokenizer.encode("\n", add_special_tokens=False) + list(
        tokenizer.apply_chat_template(
            [t.messages[2]], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert observed == expected


#: tensors verl's agent loop puts in the batch (``AgentLoopWorker._postprocess``)
VERL_TENSOR_KEYS = {"prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                    "rm_scores", "rollout_log_probs"}


def test_extra_fields_do_not_collide_with_verl_batch_tensors(lm, search_url):
    """verl copies every extra field into non_tensor_batch; a tensor name there breaks to_tensordict()."""
    from spader_pipeline.verl_plugin.trajectory import MASK_FIELD

    _, tokenizer = lm
    loop = _loop(lm, search_url)
    loop.server_manager = ScriptedServer(tokenizer)
    output = asyncio.run(loop.run({}, raw_prompt=PROMPT, extra_info={}))
    assert not set(output.extra_fields) & VERL_TENSOR_KEYS
    assert output.extra_fields[MASK_FIELD] == output.response_mask


def test_search_failures_are_counted_per_trajectory(lm, search_url):
    """A dead retrieval service turns every search into an error observation: the loop counts them."""
    from spader_pipeline.verl_plugin.trajectory import SEARCH_CALLS_FIELD, SEARCH_ERRORS_FIELD

    _, tokenizer = lm
    fields = {}
    for name, url in (("up", search_url), ("down", "http://127.0.0.1:9")):
        loop = _loop(lm, url, max_retries=0)
        loop.server_manager = ScriptedServer(tokenizer)
        fields[name] = asyncio.run(loop.run({}, raw_prompt=PROMPT, extra_info={})).extra_fields
    assert (fields["up"][SEARCH_CALLS_FIELD], fields["up"][SEARCH_ERRORS_FIELD]) == (1, 0)
    assert (fields["down"][SEARCH_CALLS_FIELD], fields["down"][SEARCH_ERRORS_FIELD]) == (1, 1)
    assert fields["down"]["tool_call_counts"] == 1


def test_token_builder_runs_off_the_event_loop(lm, search_url):
    """Chat-template work (prompt, assistant turns, observations) runs in the thread pool, not on the
    agent worker's event loop, as in verl's own agent loops."""
    import threading

    _, tokenizer = lm
    loop = _loop(lm, search_url)
    loop.server_manager = ScriptedServer(tokenizer)
    builder, on_loop_thread = loop.continuous_token_builder, []

    class Spy:
        def __getattr__(self, name):
            attr = getattr(builder, name)
            if name not in ("build_initial_tokens", "merge_assistant_tokens", "merge_context_tokens"):
                return attr

            def call(*args, **kwargs):
                on_loop_thread.append(threading.current_thread() is threading.main_thread())
                return attr(*args, **kwargs)

            return call

    loop.continuous_token_builder = Spy()
    output = asyncio.run(loop.run({}, raw_prompt=PROMPT, extra_info={}))
    assert output.extra_fields["finish_reason"] == "answer"
    assert len(on_loop_thread) >= 4 and not any(on_loop_thread)  # prompt, 2 turns, 1 observation
