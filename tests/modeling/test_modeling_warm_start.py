from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spader_pipeline.agent.tokens import examples_from_dialogues
from spader_pipeline.modeling.warm_start import (
    SFTExample,
    WarmStartConfig,
    example_from_tokens,
    length_buckets,
    masked_lm_loss,
    train_sft,
)

CONVERSATION = [
    {"role": "user", "content": "Question: Which countries are in West Africa?"},
    {"role": "assistant", "content": '<think>search</think>\n<tool_call>["Country in West Africa"]</tool_call>'},
    {"role": "tool", "content": "<tool_response>\nDoc 1 (Title: Ghana) Country in West Africa.\n</tool_response>"},
    {"role": "assistant", "content": '<think>done</think>\n<answer>["Ghana"]</answer>'},
]


def _encode(tok):
    return examples_from_dialogues(tok, [CONVERSATION], model_type="qwen3")[0]


def test_dialogue_examples_put_loss_on_assistant_turns_and_their_eos_only(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    example = _encode(tok)
    assert tok.decode(example.input_ids).rstrip("\n") == tok.apply_chat_template(CONVERSATION, tokenize=False).rstrip("\n")
    trained = [i for i, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
    assert tok.decode(trained) == (
        '<think>search</think>\n<tool_call>["Country in West Africa"]</tool_call><|im_end|>'
        '<think>done</think>\n<answer>["Ghana"]</answer><|im_end|>'
    )


def test_example_from_tokens_masks_the_prompt():
    ex = example_from_tokens([1, 2], [3, 4, 5], [1, 0, 1])
    assert ex.input_ids == (1, 2, 3, 4, 5) and ex.loss_mask == (0, 0, 1, 0, 1)


def test_length_buckets_cover_every_example_once_within_the_token_budget():
    examples = [SFTExample((1,) * n, (1,) * n) for n in [5, 50, 7, 48, 6, 49, 100]]
    batches = length_buckets(examples, batch_tokens=100, rng=random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(len(examples)))
    for b in batches:
        assert len(b) == 1 or max(len(examples[i].input_ids) for i in b) * len(b) <= 100


def test_masked_loss_equals_full_cross_entropy_on_the_same_positions(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (2, 12))
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[:, 6:9] = 1
    loss, n = masked_lm_loss(model, ids, attn, mask)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    sel = mask[:, 1:].bool()
    expected = torch.nn.functional.cross_entropy(logits[sel], ids[:, 1:][sel])
    assert n == 6 and torch.allclose(loss, expected, atol=1e-5)


def test_train_sft_fits_a_repeated_demonstration(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    example = _encode(tok)
    ids, attn = torch.tensor([example.input_ids]), torch.ones(1, len(example.input_ids), dtype=torch.long)
    before, _ = masked_lm_loss(model, ids, attn, torch.tensor([example.loss_mask]))
    logged = []
    summary = train_sft(model, [example] * 8, WarmStartConfig(max_steps=15, batch_tokens=1024, learning_rate=5e-3,
                                                              warmup_steps=2, log_every=5),
                        pad_id=tok.pad_token_id, on_log=lambda s, m: logged.append(s))
    after, _ = masked_lm_loss(model, ids, attn, torch.tensor([example.loss_mask]))
    assert summary["steps"] == 15 and logged == [5, 10, 15]
    assert float(after.detach()) < float(before.detach())


def test_warm_start_config_rejects_inconsistent_settings():
    with pytest.raises(ValueError):
        WarmStartConfig(learning_rate=0)
    with pytest.raises(ValueError, match="no example"):
        train_sft(None, [SFTExample((1, 2), (1, 0))], WarmStartConfig(), pad_id=0)
