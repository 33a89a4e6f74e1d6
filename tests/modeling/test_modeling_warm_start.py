from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spader_pipeline.agent.tokens import examples_from_dialogues
from spader_pipeline.modeling.warm_start import (
    SFTExample,
    WarmStartConfig,
    boundary_block,
    example_from_tokens,
    length_buckets,
    masked_lm_loss,
    planned_batches,
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


def _demonstrations(n: int, vocab: int, seed: int = 0) -> list[SFTExample]:
    """Demonstration-shaped examples: a shared 12-token instruction, then 10-40 tokens, loss on the second half."""
    rng = random.Random(seed)
    instruction = tuple(rng.randrange(3, vocab) for _ in range(12))
    examples = []
    for _ in range(n):
        rest = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(10, 40)))
        mask = (0,) * (12 + len(rest) // 2) + (1,) * (len(rest) - len(rest) // 2)
        examples.append(SFTExample(instruction + rest, mask))
    return examples


@pytest.mark.parametrize("batch_tokens", [60, 200])  # one demonstration a step, or several sharing the instruction
def test_steps_from_the_frozen_blocks_states_train_as_the_full_forward_does(tiny_model_dir, batch_tokens):
    """With the bottom blocks frozen, the SFT from boundary states computed a window of steps at a time
    takes the plain loop's batches, losses and weights (fp32 on the CPU: to float rounding), with the
    shared instruction encoded once (the CPU's default) or in every row (a GPU's)."""
    runs = {}
    for boundary, shared in ((False, True), (True, True), (True, False)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        examples = _demonstrations(24, vocab=model.config.vocab_size)
        logged = []
        config = WarmStartConfig(max_steps=20, batch_tokens=batch_tokens, learning_rate=3e-3, warmup_steps=2,
                                 log_every=1, trainable_layers=1, bf16=False, boundary_states=boundary,
                                 boundary_tokens=150, shared_prefix=shared)
        summary = train_sft(model, examples, config, pad_id=0, on_log=lambda s, m, logged=logged: logged.append(m["loss"]))
        runs[boundary, shared] = summary, logged, {n: p.detach().clone() for n, p in model.named_parameters()}
    plain, plain_losses, plain_weights = runs[False, True]
    assert plain["boundary_states"] == 0.0 and plain["shared_prefix"] == 1.0
    for shared in (True, False):
        fast, fast_losses, fast_weights = runs[True, shared]
        assert fast["boundary_states"] == 1.0 and fast["boundary_seconds"] > 0 and fast["shared_prefix"] == float(shared)
        assert plain["examples_seen"] == fast["examples_seen"] and plain["steps"] == fast["steps"] == 20
        assert fast_losses == pytest.approx(plain_losses, rel=1e-4, abs=1e-6)
        for name, weight in plain_weights.items():
            assert torch.allclose(fast_weights[name], weight, atol=1e-5), name


def test_boundary_states_are_the_devices_choice_unless_set(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    depth = model.config.num_hidden_layers
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert boundary_block(model, WarmStartConfig(trainable_layers=1), cpu) is None  # "auto": the CPU's plain loop
    assert boundary_block(model, WarmStartConfig(trainable_layers=1), cuda) == depth - 1
    assert boundary_block(model, WarmStartConfig(trainable_layers=1, boundary_states=True), cpu) == depth - 1
    assert boundary_block(model, WarmStartConfig(trainable_layers=1, boundary_states=False), cuda) is None
    assert boundary_block(model, WarmStartConfig(trainable_layers=None), cuda) is None  # nothing frozen
    assert boundary_block(model, WarmStartConfig(trainable_layers=depth), cuda) is None
    with pytest.raises(ValueError, match="boundary_states"):
        WarmStartConfig(boundary_states="yes")
    with pytest.raises(ValueError, match="shared_prefix"):
        WarmStartConfig(shared_prefix="yes")


def test_boundary_states_are_computed_for_windows_of_batches_within_the_token_budget():
    from spader_pipeline.modeling.warm_start import _with_boundary_states

    examples = [SFTExample((1,) * n, (1,) * n) for n in (10, 20, 30, 40, 200)]
    batches = [[0, 1], [2], [3, 0], [4], [1]]  # 30, 30, 50, 200 (over the budget alone), 20 tokens
    windows = []

    def compute(indices):
        windows.append(indices)
        return {i: f"states of {i}" for i in indices}

    steps = list(_with_boundary_states(iter(batches), examples, 100, compute))
    assert [b for b, _ in steps] == batches
    assert all(all(states[i] == f"states of {i}" for i in batch) for batch, states in steps)
    assert windows == [[0, 1, 2], [3, 0], [4], [1]]


def test_planned_batches_are_the_epochs_of_length_buckets_cut_at_max_steps():
    examples = _demonstrations(10, vocab=50)
    config = WarmStartConfig(max_steps=23, batch_tokens=100)
    rng = random.Random(3)
    expected = [b for _ in range(6) for b in length_buckets(examples, 100, rng)][:23]
    assert list(planned_batches(examples, config, random.Random(3))) == expected


def test_warm_start_config_rejects_inconsistent_settings():
    with pytest.raises(ValueError):
        WarmStartConfig(learning_rate=0)
    with pytest.raises(ValueError, match="no example"):
        train_sft(None, [SFTExample((1, 2), (1, 0))], WarmStartConfig(), pad_id=0)
