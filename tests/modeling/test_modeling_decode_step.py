"""The fused decoding step (modeling/decode_step.py), in C++ (modeling/native_step.py) and in Python: the
model's own forward bit for bit, for Llama and Qwen3, through decode_batch's sampling, early stops,
padding, continued turns and the boundary capture; and the model's forward wherever the step would not
be exact."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from spader_pipeline.modeling import decode_step, native_step, packed_linear
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.boundary import capture_block_output
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.decode_step import fused_decode_step
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.native_step import native_available
from spader_pipeline.modeling.packed_linear import packing_available
from spader_pipeline.modeling.precision import bf16_inference

pytestmark = pytest.mark.skipif(not packing_available(), reason="no bf16 unit or no oneDNN packing on this CPU")


@pytest.fixture(params=["native", "python"])
def step_kind(request, monkeypatch):
    """The step in C++ (where the extension builds) or the Python step."""
    if request.param == "native" and not native_available():
        pytest.skip("the native decoding step does not build on this machine")
    monkeypatch.setattr(native_step, "NATIVE_STEP", request.param == "native")
    return request.param


@pytest.fixture(params=["llama", "qwen3"])
def model(request, gqa_model_dir, step_kind):
    model = (request.getfixturevalue("tiny_llama") if request.param == "llama"
             else AutoModelForCausalLM.from_pretrained(gqa_model_dir))
    model.eval().requires_grad_(False)
    assert use_gqa_attention(model)
    return model


def _decode(model, *, sample: bool, capture: bool = False):
    """Two turns of decode_batch (a padded row, rows ending early on token 2 or their budget):
    tokens, log-probabilities, the cache's ids and (``capture``) the boundary states."""
    ids = torch.randint(3, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = GrowingKVCache(capture_states=capture)
    runs = []
    torch.manual_seed(5)
    with bf16_inference(model, "cpu", True), capture_block_output(model, 0) if capture else contextlib.nullcontext():
        first = decode_batch(model, ids, mask, cache, [10, 4, 10, 7], eos_ids={2}, pad_id=0,
                             processors=LogitsProcessorList(), do_sample=sample, log_prob_temperature=1.0)
        extra = torch.randint(3, 64, (4, 3), generator=torch.Generator().manual_seed(1))
        second = decode_batch(model, torch.cat([first.ids, extra], 1),
                              torch.cat([first.mask, torch.ones_like(extra)], 1), cache, [6] * 4, eos_ids={2},
                              pad_id=0, processors=LogitsProcessorList(), do_sample=sample, log_prob_temperature=1.0)
    runs = [(run.tokens, run.log_probs, run.ids.tolist()) for run in (first, second)]
    states = cache.states.states.clone() if capture else None
    return runs, states


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_fused_step_decodes_the_models_tokens_and_log_probs_bit_for_bit(model, monkeypatch, sample):
    fused, _ = _decode(model, sample=sample)
    monkeypatch.setattr(decode_step, "FUSED_DECODE_STEP", False)
    assert _decode(model, sample=sample)[0] == fused  # ==: the same floats, not within a tolerance


def test_decoding_steps_bypass_the_models_forward(model):
    """Only the prefills call the model; every decoding step runs the fused step."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with bf16_inference(model, "cpu", True):
        assert fused_decode_step(model) is None  # a forward hook of someone else's: it would miss the steps
    model._forward_pre_hooks.clear()
    forward = model.forward
    model.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]
    ids = torch.randint(3, 64, (2, 5))
    with bf16_inference(model, "cpu", True):
        result = decode_batch(model, ids, torch.ones_like(ids), GrowingKVCache(), [6, 6], eos_ids=set(), pad_id=0,
                              processors=LogitsProcessorList(), do_sample=False)
    assert result.steps == 6 and len(calls) == 1


def test_the_boundary_states_are_the_blocks_output_as_the_hook_records_it(model, monkeypatch):
    fused, fused_states = _decode(model, sample=False, capture=True)
    monkeypatch.setattr(decode_step, "FUSED_DECODE_STEP", False)
    hooked, hooked_states = _decode(model, sample=False, capture=True)
    assert fused == hooked and torch.equal(fused_states, hooked_states)
    assert fused_states.shape[1] == len(fused[1][2][0])  # every cached position has its state
    monkeypatch.setattr(decode_step, "FUSED_DECODE_STEP", True)
    with bf16_inference(model, "cpu", True), capture_block_output(model, 0):
        assert fused_decode_step(model) is not None  # the capture's own hook is no reason to step aside


def test_a_weight_changed_in_place_reaches_the_next_decoding_call(model):
    """An optimizer step or a weight sync writes in place: the stacked q|k|v and gate|up weights are
    packed again, so the step still equals the model's forward."""
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)

    def step_and_forward():
        with bf16_inference(model, "cpu", True):
            cache = GrowingKVCache()
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache, use_cache=True)
            reference = GrowingKVCache()
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=reference, use_cache=True)
            position = torch.full((2, 1), ids.shape[1] - 1)
            step = fused_decode_step(model)
            fused = step(input_ids=ids[:, -1:], attention_mask=mask, position_ids=position, cache=cache)
            expected = model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=position,
                             past_key_values=reference, use_cache=True).logits[:, -1]
        return fused, expected

    before = step_and_forward()[0]
    with torch.no_grad():
        model.model.layers[-1].mlp.up_proj.weight.mul_(1.5)
        model.model.layers[0].self_attn.k_proj.weight.add_(0.05)
    fused, expected = step_and_forward()
    assert torch.equal(fused, expected) and not torch.equal(fused, before)


def test_where_the_step_would_not_be_the_models_forward_there_is_none(model, monkeypatch):
    assert fused_decode_step(model) is None  # with gradients
    with torch.no_grad():
        assert fused_decode_step(model) is None  # no autocast: fp32 products
    with bf16_inference(model, "cpu", True):
        assert fused_decode_step(model) is not None
        monkeypatch.setattr(packed_linear, "PACK_WEIGHTS", False)
        assert fused_decode_step(model) is None  # autocast's own products
        monkeypatch.setattr(packed_linear, "PACK_WEIGHTS", True)
        model.config._attn_implementation = "sdpa"  # bf16 attention under autocast: not the step's fp32
        assert fused_decode_step(model) is None



@pytest.mark.skipif(not native_available(), reason="the native decoding step does not build on this machine")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_native_step_is_the_python_steps_logits_and_cache_bit_for_bit(family, request, gqa_model_dir, monkeypatch):
    """One step each from the same prefilled cache, with a padded row: the same logits and the same new
    key and value positions."""
    model = (request.getfixturevalue("tiny_llama") if family == "llama"
             else AutoModelForCausalLM.from_pretrained(gqa_model_dir))
    model.eval().requires_grad_(False)
    assert use_gqa_attention(model)
    ids = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[2, :2] = 0
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    results = []
    for native in (True, False):
        monkeypatch.setattr(native_step, "NATIVE_STEP", native)
        with bf16_inference(model, "cpu", True):
            cache = GrowingKVCache()
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=position[:, :-1], past_key_values=cache,
                  use_cache=True)
            step = fused_decode_step(model)
            assert (step.native is not None) == native
            logits = step(input_ids=ids[:, -1:], attention_mask=mask, position_ids=position[:, -1:], cache=cache)
        results.append((logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]))
    (native_logits, native_cache), (python_logits, python_cache) = results
    assert native_logits.dtype == torch.bfloat16 and torch.equal(native_logits, python_logits)
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(native_cache, python_cache, strict=True)
               for a, b in zip(pair_a, pair_b, strict=True))
