"""sdpa_gqa: grouped-query attention without KV copies gives the same outputs, gradients included."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from spader_pipeline.modeling.attention import use_gqa_attention


def test_gqa_attention_matches_sdpa_in_forward_backward_and_generation(gqa_model_dir, tmp_path):
    ids = torch.randint(3, 64, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the case where sdpa copies the KV heads

    def run(model):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[mask.bool()].square().mean().backward()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        return logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone(), out

    reference = run(AutoModelForCausalLM.from_pretrained(gqa_model_dir))
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir)
    assert use_gqa_attention(model) and model.config._attn_implementation == "sdpa_gqa"
    fast = run(model)
    assert torch.allclose(reference[0][mask.bool()], fast[0][mask.bool()], atol=1e-5)
    assert torch.allclose(reference[1], fast[1], atol=1e-6) and torch.equal(reference[2], fast[2])
    model.save_pretrained(tmp_path / "saved")  # a runtime setting, not written to the checkpoint
    assert "sdpa_gqa" not in (tmp_path / "saved" / "config.json").read_text()


def test_a_decoding_step_under_cpu_autocast_attends_in_fp32():
    """One query position under bf16 autocast: the attention of fp32 inputs, not of bf16-rounded ones
    (the cache's keys arrive in fp32 and its values in bf16, as in a rotary model under autocast)."""
    from spader_pipeline.modeling.attention import sdpa_gqa_attention_forward

    torch.manual_seed(0)
    query, key = torch.randn(2, 6, 1, 16), torch.randn(2, 2, 40, 16)
    value = torch.randn(2, 2, 40, 16).bfloat16()
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1, ..., :7] = False
    module = torch.nn.Module()
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value.float(), attn_mask=mask,
                                                                enable_gqa=True).transpose(1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoded, _ = sdpa_gqa_attention_forward(module, query, key, value, mask)
        prefill, _ = sdpa_gqa_attention_forward(module, query.expand(2, 6, 3, 16), key, value.float(), None)
    assert decoded.dtype == torch.float32 and torch.allclose(decoded, expected, atol=1e-6)
    assert prefill.dtype == torch.bfloat16  # several query positions keep autocast
