"""The decoding attention over a bf16 cache (modeling/decode_attention.py): fp32 SDPA's result on the same
keys and values, and, for the cache in bf16, a bounded change of the samples: greedy text unchanged on
the tiny models and each token's log-probability within a stated bound of the fp32 cache's. The cache is
bf16 whether the native attention builds or not (the path with and without it:
test_modeling_decoding_path.py)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from spader_pipeline.modeling import decode_attention, native_step
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.decode_attention import bf16_decode_attention_available
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.precision import bf16_inference

needs_kernel = pytest.mark.skipif(not bf16_decode_attention_available(),
                                  reason="the native decoding attention does not build on this machine")

#: largest change of a sampled token's log-probability the bf16 key cache may make on the tiny models,
#: up to the first token where the two runs part (measured: up to 0.004; their logits are small, so bf16's
#: step at their magnitude is 1/64 or finer). On SmolLM2, whose logits reach 20-30, one bf16 step of a
#: logit is 0.125 and the measured change is that step (docs/performance.md).
LOG_PROB_BOUND = 0.01


@needs_kernel
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim"), [(1, 9, 3, 32), (7, 4, 2, 64), (3, 6, 6, 128), (2, 4, 2, 40)])
def test_the_native_attention_is_fp32_sdpa_on_the_same_cache(rows, heads, kv_heads, dim):
    """Within fp32 reassociation of SDPA on the same bf16 keys and values (cache views with spare
    capacity, a padded row), for one row and many, grouped heads and not, head dimensions that fill
    vector registers and one that does not (the plain loops)."""
    generator = torch.Generator().manual_seed(rows)
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    keys = torch.randn(rows, kv_heads, 90, dim, generator=generator).to(torch.bfloat16)[:, :, :77]
    values = torch.randn(rows, kv_heads, 90, dim, generator=generator).to(torch.bfloat16)[:, :, :77]
    mask = torch.ones(rows, 77, dtype=torch.bool)
    mask[0, :20] = False
    with torch.no_grad():
        for row_mask in (mask, None):
            got = decode_attention.decode_attention(query, keys, values, row_mask, 0.17)
            expected = decode_attention.decode_attention(query, keys, values, row_mask, 0.17, native=False)
            assert got.shape == (rows, heads, 1, dim) and got.dtype == torch.float32
            assert (got - expected).abs().max() < 1e-5


def _greedy_runs(model, bf16_cache: bool, monkeypatch) -> list:
    """Greedy decoding of 24 tokens for 4 rows (one padded), then a continued turn of 12, with the cache's
    keys in bf16 or fp32."""
    monkeypatch.setattr(decode_attention, "BF16_CACHE", bf16_cache)
    ids = torch.randint(3, 64, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    cache = GrowingKVCache()
    with bf16_inference(model, "cpu", True):
        first = decode_batch(model, ids, mask, cache, [24] * 4, eos_ids=set(), pad_id=0,
                             processors=LogitsProcessorList(), do_sample=False, log_prob_temperature=1.0)
        more = torch.randint(3, 64, (4, 3), generator=torch.Generator().manual_seed(1))
        second = decode_batch(model, torch.cat([first.ids, more], 1), torch.cat([first.mask, torch.ones_like(more)], 1),
                              cache, [12] * 4, eos_ids=set(), pad_id=0, processors=LogitsProcessorList(),
                              do_sample=False, log_prob_temperature=1.0)
    assert cache.layers[0].keys.dtype == (torch.bfloat16 if bf16_cache else torch.float32)
    return [first, second]


def _log_prob_changes(bf16_run, fp32_run) -> list[float]:
    """Per row, each token's log-probability change up to the first token where the runs part."""
    changes = []
    for tokens_a, tokens_b, log_a, log_b in zip(bf16_run.tokens, fp32_run.tokens, bf16_run.log_probs,
                                                fp32_run.log_probs, strict=True):
        common = min(len(tokens_a), len(tokens_b))
        same = next((i for i in range(common) if tokens_a[i] != tokens_b[i]), common)  # first token that parts
        upto = min(same + 1, common)  # the parting token itself is compared too
        changes += [abs(a - b) for a, b in zip(log_a[:upto], log_b[:upto], strict=True)]
    return changes


def test_a_bf16_cache_keeps_the_tiny_models_greedy_text_and_moves_log_probs_within_the_bound(gqa_model_dir,
                                                                                            monkeypatch):
    """The tests' tiny model (Qwen3, grouped-query): the same greedy text, both turns."""
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval().requires_grad_(False)
    use_gqa_attention(model)
    for bf16_run, fp32_run in zip(_greedy_runs(model, True, monkeypatch), _greedy_runs(model, False, monkeypatch),
                                  strict=True):
        assert bf16_run.tokens == fp32_run.tokens
        assert max(_log_prob_changes(bf16_run, fp32_run)) <= LOG_PROB_BOUND


def test_on_a_random_llama_log_probs_move_within_the_bound(tiny_llama, monkeypatch):
    """A randomly initialised Llama samples from a near-uniform distribution (log-probabilities about
    -3.8 over 64 tokens), where a change of a few thousandths can flip a near-tie: its greedy text may part; up to
    where it does, every log-probability stays within the bound."""
    model = tiny_llama.eval().requires_grad_(False)
    use_gqa_attention(model)
    for bf16_run, fp32_run in zip(_greedy_runs(model, True, monkeypatch), _greedy_runs(model, False, monkeypatch),
                                  strict=True):
        assert max(_log_prob_changes(bf16_run, fp32_run)) <= LOG_PROB_BOUND


def test_where_the_extension_does_not_build_the_keys_are_bf16_and_one_warning_says_so(monkeypatch, tmp_path, caplog):
    """A build that fails (here: a source that does not compile) leaves the extension unavailable, with one
    warning per process that says how to build it, and the keys rounded to bf16 all the same: held in fp32,
    where fp32 SDPA reads them as it reads the widened bf16 cache."""
    broken = tmp_path / "decode_step.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native_step, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(native_step, "_built", functools.lru_cache(maxsize=1)(native_step._built.__wrapped__))
    monkeypatch.setattr(native_step, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=native_step.__name__):
        assert not bf16_decode_attention_available()
        native_step._built.__wrapped__()  # a second failed build in the same process: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "C++ decoding step" in r.getMessage()]
    assert len(warnings) == 1 and "install a C++ compiler" in warnings[0] and "make install" in warnings[0]
    from spader_pipeline.modeling.kv_cache import GrowingLayer

    layer = GrowingLayer()
    keys, values = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8).to(torch.bfloat16)
    layer.update(keys, values)
    layer.update(keys[:, :, :1] * 2, values[:, :, :1])  # a decoding step: the cache is a view with spare room
    bf16_keys = torch.cat([keys, keys[:, :, :1] * 2], 2).to(torch.bfloat16)
    bf16_values = torch.cat([values, values[:, :, :1]], 2)
    assert layer.keys.dtype == torch.float32 and torch.equal(layer.keys, bf16_keys.float())
    query, mask = torch.randn(2, 4, 1, 8), torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        got = decode_attention.decode_attention(query, layer.keys, layer.values, mask, 0.5)
    assert torch.equal(got, native_step.sdpa_decode_reference(query, bf16_keys, bf16_values, mask, 0.5))
