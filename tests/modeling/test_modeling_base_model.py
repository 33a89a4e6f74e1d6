from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spader_pipeline.modeling import count_parameters, validate_model_dir
from spader_pipeline.modeling.tokenizer import PROTOCOL_TOKENS, train_tokenizer


def test_protocol_tags_are_single_tokens_that_survive_skip_special_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for tag in PROTOCOL_TOKENS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    text = '<think>x</think>\n<tool_call>["Ghana"]</tool_call>'
    ids = tok.encode(text + "<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders_qwen3_style_turns_and_wraps_tool_messages(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "<answer>[]</answer>"},
        {"role": "tool", "content": "Doc 1"},
        {"role": "tool", "content": "<tool_response>\nDoc 2\n</tool_response>"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n<answer>[]</answer><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nDoc 1\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nDoc 2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_built_model_loads_with_auto_classes_and_generates(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id
    assert count_parameters(model) < 200_000
    ids = tok.apply_chat_template([{"role": "user", "content": "Q?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 4 and torch.equal(out[:, : ids.shape[1]], ids)
    assert validate_model_dir(tiny_model_dir)["model_type"] == "qwen3"


def test_validate_model_dir_explains_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        validate_model_dir(tmp_path)


def test_tokenizer_rejects_a_vocabulary_smaller_than_the_byte_alphabet():
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["abc"], vocab_size=100)
