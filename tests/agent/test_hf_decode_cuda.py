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


def test_greedy_turns_on_cuda_under_bf16_keep_autocast_in_attention(monkeypatch):
    from spader_pipeline.modeling import attention
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_tiny_qwen3
    from spader_pipeline.modeling.tokenizer import train_tokenizer

    texts = [r["contents"] for r in corpus_records()] + [q["question"] for q in QUESTIONS]
    tokenizer = train_tokenizer(texts, vocab_size=600, min_frequency=1)
    spec = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128)
    model = build_tiny_qwen3(tokenizer, spec, seed=0).to("cuda").eval()
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
