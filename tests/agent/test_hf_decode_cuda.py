"""The rollout's generator on one CUDA GPU under bf16 autocast: grouped-query attention, the cache
continued over turns, and the GPU's attention left in autocast (the fp32 decoding path is CPU's)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from agent_toy_data import QUESTIONS, corpus_records

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.types import RolloutState, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tiny_cuda_model():
    """A tiny grouped-query Qwen3 on the GPU with a tokenizer trained on the toy corpus."""
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_tiny_qwen3
    from spader_pipeline.modeling.tokenizer import train_tokenizer

    texts = [r["contents"] for r in corpus_records()] + [q["question"] for q in QUESTIONS]
    tokenizer = train_tokenizer(texts, vocab_size=600, min_frequency=1)
    spec = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128)
    return build_tiny_qwen3(tokenizer, spec, seed=0).to("cuda").eval(), tokenizer


def test_greedy_turns_on_cuda_under_bf16_keep_autocast_in_attention(monkeypatch):
    from spader_pipeline.modeling import attention

    model, tokenizer = _tiny_cuda_model()
    assert attention.use_gqa_attention(model)
    calls = []
    original = attention._cpu_autocast_decoding
    monkeypatch.setattr(attention, "_cpu_autocast_decoding", lambda query: calls.append(original(query)) or calls[-1])

    def roll():
        gen = HFGenerator(model, tokenizer, SamplingParams(temperature=0.0, max_new_tokens=8), bf16=True)
        states = [RolloutState(sample={}, messages=[], token_ids=tokenizer.encode(q["question"]),
                               prompt_length=len(tokenizer.encode(q["question"])), max_response_tokens=40, uid=f"t{i}")
                  for i, q in enumerate(QUESTIONS)]
        tokens = []
        for _ in range(2):  # the second turn continues the first's cache
            turns = asyncio.run(gen.generate(states))
            for state, turn in zip(states, turns, strict=True):
                state.token_ids += list(turn.token_ids) + tokenizer.encode(" Doc 1 (Title: Ghana) Accra.")
            tokens.append([list(t.token_ids) for t in turns])
        return gen, tokens

    gen, first = roll()
    _, second = roll()
    assert gen.kv_reuses == 1 and gen.generated_tokens > 0
    assert first == second  # greedy on the GPU: the same tokens twice
    assert calls and not any(calls)  # decoding steps reached the attention, and CUDA kept autocast


def test_captured_states_stay_on_the_gpu_and_a_call_waits_for_it_a_bounded_number_of_times(monkeypatch):
    """The boundary states a rollout captures stay on the GPU, where the update reads them, and copying
    them out of the cache waits for the device a few times a generation call, not per row."""
    import warnings

    from spader_pipeline.agent.state_capture import StateCapture

    model, tokenizer = _tiny_cuda_model()
    waits = []
    record = StateCapture.record

    def counted(self, *args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                kept = record(self, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits.append(sum("synchroniz" in str(w.message) for w in caught))
        return kept

    monkeypatch.setattr(StateCapture, "record", counted)
    gen = HFGenerator(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0),
                      capture_states_from_layer=0, bf16=True)
    questions = [q["question"] for q in QUESTIONS] * 4  # more rows than waits allowed
    states = [RolloutState(sample={}, messages=[], token_ids=tokenizer.encode(q), prompt_length=len(tokenizer.encode(q)),
                           max_response_tokens=40, uid=f"t{i}") for i, q in enumerate(questions)]
    for state in states:
        gen.start(state)
    asyncio.run(gen.generate(states))
    captured = gen.captured_states()
    assert len(captured) == len(states) and all(c is not None for c in captured)
    assert all(c.states.device.type == "cuda" and c.token_ids.device.type == "cpu" for c in captured)
    assert waits and max(waits) <= 3 < len(states)  # the mask and ids read, the positions sent; not per row
