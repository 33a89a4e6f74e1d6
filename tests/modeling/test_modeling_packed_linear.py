"""bf16 weights packed for oneDNN (modeling/packed_linear.py): the same products as autocast, bit for bit,
re-packed when a weight changes, and never in a computation that needs gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from spader_pipeline.modeling import packed_linear
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.packed_linear import packed_bf16_linears, packing_available
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
def test_packed_weights_decode_the_same_tokens_and_log_probs_bit_for_bit(model, monkeypatch):
    """Prefill, decoding and a continued turn under bf16 autocast: the same tokens and the same fp32
    log-probabilities (``==``, not within a tolerance) with the weights packed as without."""
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


def test_where_packed_products_differ_from_autocasts_nothing_is_packed(model, monkeypatch):
    """The machine's own check (oneDNN may take another kernel for the packed layout on another CPU)."""
    monkeypatch.setattr(packed_linear, "_packing_matches_autocast", lambda: False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_bf16_linears(model) as packed:
        assert packed == 0


def test_without_a_bf16_unit_nothing_is_packed(model, monkeypatch):
    monkeypatch.setattr(packed_linear, "cpu_has_bf16", lambda: False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_bf16_linears(model) as packed:
        assert packed == 0
    assert not any("forward" in m.__dict__ for m in model.modules())

