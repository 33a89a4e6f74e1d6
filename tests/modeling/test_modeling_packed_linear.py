"""bf16 weights packed for oneDNN (modeling/packed_linear.py): autocast's products, bit for bit where this
machine's oneDNN sums both in one order and to the last bf16 bit elsewhere, re-packed when a weight changes,
and never in a computation that needs gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from spader_pipeline.modeling import packed_linear
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.packed_linear import (
    MATCH_CHECK_ROWS,
    MATCH_CHECK_SHAPES,
    packed_bf16_linears,
    packed_product,
    packing_available,
    packing_matches_autocast,
)
from spader_pipeline.modeling.precision import bf16_inference

needs_packing = pytest.mark.skipif(not packing_available(), reason="no bf16 unit or no oneDNN packing on this CPU")


@pytest.fixture
def model(gqa_model_dir):
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    model.requires_grad_(False)
    return model


def _decode(model, ids, mask):
    """Greedy decoding of 12 tokens, then a continued turn: tokens and each step's log-probability."""
    cache = GrowingKVCache()
    runs = []
    with bf16_inference(model, "cpu", True):
        first = decode_batch(model, ids, mask, cache, [12] * len(ids), eos_ids=set(), pad_id=0,
                             processors=LogitsProcessorList(), do_sample=False, log_prob_temperature=1.0)
        runs.append(first)
        extra = torch.randint(3, 64, (len(ids), 4), generator=torch.Generator().manual_seed(1))
        more = decode_batch(model, torch.cat([first.ids, extra], 1),
                            torch.cat([first.mask, torch.ones_like(extra)], 1), cache, [6] * len(ids),
                            eos_ids=set(), pad_id=0, processors=LogitsProcessorList(), do_sample=False,
                            log_prob_temperature=1.0)
        runs.append(more)
    return [(run.tokens, run.log_probs) for run in runs]


@needs_packing
@pytest.mark.parametrize("shape", [*MATCH_CHECK_SHAPES, (49152, 576), (96, 48), (16, 48)],
                         ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_packed_products_are_autocasts_up_to_their_sums_order(shape):
    """Both are oneDNN's bf16 products of the same bf16 values with fp32 sums, rounded to bf16. Where the
    packed layout blocks the sums otherwise (an AMX Xeon above 32 rows, narrow shapes), an output moves by
    what another order of fp32 sums moves it (at most ``in`` fp32 roundings of the terms' magnitudes) and
    one bf16 rounding step (2^-7 of the value), never more; where this machine's check found them to
    match, the same bits."""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    for rows in (1, 7, 16, 32, 33, 64, 300):
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        ours, autocasts = packed_product(x, (packed, None)).float(), torch.nn.functional.linear(x, weight).float()
        if packing_matches_autocast() and shape in MATCH_CHECK_SHAPES and rows in MATCH_CHECK_ROWS:
            assert torch.equal(ours, autocasts), rows  # what the machine's check found, on other values
        magnitude = x.float().abs() @ weight.float().abs().T  # the terms' sum of magnitudes, per output
        bound = ours.abs().maximum(autocasts.abs()) * 2**-7 + magnitude * in_features * 2**-24
        assert bool(((ours - autocasts).abs() <= bound).all()), rows


@needs_packing
def test_packed_weights_decode_the_same_tokens_and_log_probs_bit_for_bit(model, monkeypatch):
    """Prefill, decoding and a continued turn under bf16 autocast: the same tokens and the same fp32
    log-probabilities (``==``, not within a tolerance) with the weights packed as without, where this
    machine's packed products are autocast's."""
    if not packing_matches_autocast():
        pytest.skip("this CPU's packed products round a few outputs otherwise than autocast's")
    ids = torch.randint(3, 64, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    packed = _decode(model, ids, mask)
    monkeypatch.setattr(packed_linear, "PACK_WEIGHTS", False)
    assert _decode(model, ids, mask) == packed


@needs_packing
def test_every_linear_layer_is_packed_and_restored_after(model):
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_bf16_linears(model) as packed:
        assert packed == len(linears) and all("forward" in m.__dict__ for m in linears)
    assert not any("forward" in m.__dict__ for m in linears)


@needs_packing
def test_a_changed_weight_is_packed_again_and_only_it(model, monkeypatch):
    """An in-place update (as an optimizer step or a weight sync writes) reaches the next block's
    products; the layers that did not change keep their packed copy."""
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(2))

    def logits(pack: bool) -> torch.Tensor:
        monkeypatch.setattr(packed_linear, "PACK_WEIGHTS", pack)
        with bf16_inference(model, "cpu", True):
            return model(input_ids=ids).logits

    logits(True)
    before = dict(packed_linear._PACKED[model])
    changed = model.model.layers[-1].mlp.down_proj
    with torch.no_grad():
        changed.weight.add_(0.05)  # in place, as optimizer.step() writes
        model.state_dict()["model.layers.0.self_attn.q_proj.weight"].mul_(1.5)  # as a weight sync copies
    assert torch.equal(logits(True), logits(False))
    after = packed_linear._PACKED[model]
    renewed = {m for m in after if after[m][1] is not before[m][1]}
    assert renewed == {(changed,), (model.model.layers[0].self_attn.q_proj,)}


@needs_packing
def test_with_gradients_a_layer_runs_as_it_is(model):
    """Packed products carry no gradient: a forward that needs one (the trainer's update, here under
    the same context) runs autocast's own layer, and its gradients arrive."""
    layer = model.model.layers[-1].mlp.down_proj
    layer.weight.requires_grad_(True)
    ids = torch.randint(3, 64, (1, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_bf16_linears(model):
        model(input_ids=ids).logits.float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_without_a_bf16_unit_nothing_is_packed(model, monkeypatch):
    monkeypatch.setattr(packed_linear, "cpu_has_bf16", lambda: False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_bf16_linears(model) as packed:
        assert packed == 0
    assert not any("forward" in m.__dict__ for m in model.modules())

