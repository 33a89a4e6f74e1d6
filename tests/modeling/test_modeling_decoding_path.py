"""The decoding path and what it changes (modeling/decode_step.py:decoding_path): a run decodes the same
tokens for the same seed with the C++ step, with the Python step, and where the C++ step did not build (the
Python step with the same bf16 keys, attending with fp32 SDPA), on the tests' tiny models and on SmolLM2's
shape; and the path each of these reports."""

from __future__ import annotations

import pytest
import torch
from decoding_runs import SMOLLM2_135M, parting
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from spader_pipeline.modeling import decode_attention, decode_step, native_step, packed_linear
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.decode_step import decoding_path, fused_decode_step
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.native_step import native_available
from spader_pipeline.modeling.packed_linear import packing_available
from spader_pipeline.modeling.precision import bf16_inference

pytestmark = pytest.mark.skipif(not packing_available(), reason="no bf16 unit or no oneDNN packing on this CPU")

#: the largest change of a token's log-probability between the C++ attention and fp32 SDPA over the same bf16
#: cache, up to the first token where two runs part: the two sum the same fp32 products in another order, so a
#: bf16 value computed from the sums (a product's input, a logit) can round to its neighbour. Measured: 0 on the
#: tiny models, 0.016 on SmolLM2's shape (one bf16 step of a logit between 2 and 4; at a trained SmolLM2's logits
#: of 16-32 one step is 0.125)
LOG_PROB_BOUND = 0.05
#: the paths compared: the C++ step; the Python step (same attention); the C++ step not built
PATHS = ("cpp", "python", "not built")


def _smollm2_shaped() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))


def _as_path(path: str, monkeypatch) -> None:
    """Decode as ``path`` says from now on in this test: the C++ step, the Python step, or no C++ build."""
    monkeypatch.setattr(native_step, "NATIVE_STEP", path == "cpp")
    monkeypatch.setattr(native_step, "_built", (lambda: False) if path == "not built" else native_step._built)


def _decode(model, *, sample: bool):
    """Two turns of decode_batch for 4 rows (one padded; rows ending on token 2 or their budget) from seed 5:
    per turn, the tokens and log-probabilities."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = GrowingKVCache()
    torch.manual_seed(5)
    common = dict(eos_ids={2}, pad_id=0, processors=LogitsProcessorList(), do_sample=sample, log_prob_temperature=1.0)
    with bf16_inference(model, "cpu", True):
        first = decode_batch(model, ids, mask, cache, [12, 4, 12, 8], **common)
        extra = torch.randint(3, vocab, (4, 3), generator=torch.Generator().manual_seed(1))
        second = decode_batch(model, torch.cat([first.ids, extra], 1), torch.cat([first.mask, torch.ones_like(extra)], 1),
                              cache, [8] * 4, **common)
    keys = cache.layers[0].keys
    assert torch.equal(keys, keys.to(torch.bfloat16).to(keys.dtype))  # every path: bf16 keys
    return [(run.tokens, run.log_probs) for run in (first, second)]


def _runs(model, sample: bool, monkeypatch) -> dict[str, list]:
    """:func:`_decode` on each of :data:`PATHS`, checking that each decodes as it says."""
    runs = {}
    for path in PATHS:
        _as_path(path, monkeypatch)
        with bf16_inference(model, "cpu", True):
            step = fused_decode_step(model)
        assert step is not None and (step.native is not None) == (path == "cpp")
        assert decoding_path("cpu", True)["decode.attention"] == ("sdpa" if path == "not built" else "cpp")
        runs[path] = _decode(model, sample=sample)
    return runs


needs_native = pytest.mark.skipif(not native_available(), reason="the C++ step does not build here: nothing to compare")


@needs_native
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_same_seed_samples_the_same_tokens_with_or_without_the_cpp_step(tiny_model, sample, monkeypatch):
    """The tiny models: the C++ step and the Python step, the same floats; the Python step where the C++
    step did not build (fp32 SDPA over the same bf16 keys), the same tokens and every log-probability
    within :data:`LOG_PROB_BOUND` (measured: the same floats too)."""
    runs = _runs(tiny_model, sample, monkeypatch)
    assert runs["cpp"] == runs["python"]  # ==: the same floats
    assert [tokens for tokens, _ in runs["not built"]] == [tokens for tokens, _ in runs["cpp"]]
    assert max(change for _, change in parting(runs["cpp"], runs["not built"])) <= LOG_PROB_BOUND


@needs_native
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_on_smollm2s_shape_the_runs_agree_until_a_logits_last_bit_decides(sample, monkeypatch):
    """SmolLM2's shape (random weights): with the C++ step or the Python step, the same floats. Without the
    C++ build a run parts from the C++ step's only where a logit's last bf16 bit decides a token, and up to
    there its log-probabilities are within :data:`LOG_PROB_BOUND`. Greedy, that is a near-tie of the two
    largest logits: none on this seed (every token the same), 2 of 16 rows over 40 tokens on another. Sampled
    from random weights, every draw is from a near-uniform distribution over 49,152 tokens (log-probabilities
    about -10.8), where that bit moves the draw's cumulative sums by about a token's share, so rows part
    within a few tokens; a trained model's peaked distribution rarely leaves a draw that close to a boundary."""
    model = _smollm2_shaped().eval().requires_grad_(False)
    assert use_gqa_attention(model)
    runs = _runs(model, sample, monkeypatch)
    assert runs["cpp"] == runs["python"]
    shared = parting(runs["cpp"], runs["not built"])
    assert max(change for _, change in shared) <= LOG_PROB_BOUND
    tokens = sum(len(row) for row_tokens, _ in runs["cpp"] for row in row_tokens)
    assert sum(same for same, _ in shared) >= (0.9 * tokens if not sample else 1)


def test_the_path_reports_each_switch(monkeypatch):
    """What decoding_path says on this machine's CPU as the module switches and settings change."""
    monkeypatch.setattr(native_step, "_built", lambda: True)  # as where it builds (nothing decodes here)
    assert decoding_path("cpu", True) == {"decode.step": "cpp", "decode.attention": "cpp", "decode.kv_cache": "bf16",
                                          "decode.packed_weights": "on", "decode.kernels": "cpp"}
    monkeypatch.setattr(native_step, "NATIVE_STEP", False)
    assert decoding_path("cpu", True)["decode.step"] == "python"
    monkeypatch.setattr(native_step, "_built", lambda: False)
    assert decoding_path("cpu", True) == {"decode.step": "python", "decode.attention": "sdpa", "decode.kv_cache": "bf16",
                                          "decode.packed_weights": "on", "decode.kernels": "aten"}
    monkeypatch.setattr(decode_attention, "BF16_CACHE", False)
    assert decoding_path("cpu", True)["decode.kv_cache"] == "fp32"
    monkeypatch.setattr(decode_step, "FUSED_DECODE_STEP", False)
    assert decoding_path("cpu", True)["decode.step"] == "transformers"
    monkeypatch.setattr(packed_linear, "PACK_WEIGHTS", False)
    assert decoding_path("cpu", True)["decode.packed_weights"] == "off"
    monkeypatch.undo()
    assert decoding_path("cpu", False) == {"decode.step": "transformers", "decode.attention": "sdpa",
                                           "decode.kv_cache": "fp32", "decode.packed_weights": "off",
                                           "decode.kernels": "aten"}
    assert decoding_path("cpu", True, bf16_weights=True)["decode.step"] == "transformers"
    assert decoding_path("meta", True) == {"decode.step": "transformers", "decode.attention": "sdpa",
                                           "decode.kv_cache": "bf16", "decode.packed_weights": "off",
                                           "decode.kernels": "aten"}
