"""The static step's work between its products as fused Triton kernels (modeling/triton_step.py): each kernel
computes what the torch operations it replaces compute, the static step with them gives the step without
them (what a block of it launches through torch: test_modeling_graph_decode.py).

Where Triton runs: a CUDA GPU, or a CPU with Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is
imported; ``gpu_issue63.sh rehearse`` runs these so). CI's CPU torch has no Triton: these skip there. The
interpreter's casts to bf16 truncate, so there the kernels are checked in fp32 and fp16; on a GPU in bf16 too.
The kernels built for the H200 by Triton's own compiler (no GPU needed): the last test."""

from __future__ import annotations

import collections
import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from decoding_runs import SMOLLM2_135M, parting
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from spader_pipeline.modeling import graph_decode, static_cache, triton_attention, triton_step
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.boundary import capture_block_output
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.decode_step import _rms_norm, decoding_path, rotated_query_keys
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.static_cache import StaticKVCache

pytestmark = pytest.mark.skipif(not triton_attention.available(),
                                reason="needs Triton: a CUDA GPU, or its interpreter (TRITON_INTERPRET=1)")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
#: the largest difference from torch's operations, relative to the values' scale: a norm's sum and the
#: activation's exp round in another order (fp32), then the output's own rounding (its dtype's half ulp)
BOUNDS = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _norm(width: int, eps: float, generator: torch.Generator) -> torch.nn.Module:
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.nn.Parameter((1 + 0.1 * torch.randn(width, generator=generator)).to(DEVICE)), eps
    return norm


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = expected.float().abs().amax().clamp_min(1.0)
    return (out.float() - expected.float()).abs().amax().item() <= BOUNDS[dtype] * scale.item()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add-and-norm"])
def test_residual_norm_is_the_add_and_the_models_norm(dtype, with_delta):
    """The residual (fp32) plus a product's output (``dtype``), written back in place, and the block's RMSNorm of
    it (the model's formula, fp32) in ``dtype``: at SmolLM2's width (576, a masked block of 1,024)."""
    generator = torch.Generator().manual_seed(1)
    residual = (3 * torch.randn(5, 576, generator=generator)).to(DEVICE)
    delta = torch.randn(5, 576, generator=generator).to(DEVICE, dtype) if with_delta else None
    norm = _norm(576, 1e-5, generator)
    expected_residual = residual + delta.float() if with_delta else residual.clone()
    expected = _rms_norm(expected_residual, norm).to(dtype)
    normed = triton_step.residual_norm(residual, delta, norm.weight, norm.variance_epsilon, dtype)
    assert normed.dtype == dtype and normed.shape == (5, 576)
    assert torch.equal(residual, expected_residual)  # the add is exact: one fp32 rounding, as torch's
    assert _close(normed, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_embed_norm_is_the_embedding_the_positions_mark_and_the_first_norm(dtype):
    """A step's start: each row's token embedded (fp32, the residual stream: the same bits as ``F.embedding``),
    its position at the cursor marked attendable (no other), and the first block's norm of it in ``dtype``."""
    generator = torch.Generator().manual_seed(3)
    embed = torch.randn(300, 576, generator=generator).to(DEVICE)
    token = torch.tensor([5, 299, 0, 5], device=DEVICE)
    norm = _norm(576, 1e-5, generator)
    valid = torch.zeros(6, 40, dtype=torch.bool, device=DEVICE)
    valid[:, :10] = True
    expected_valid = valid.clone()
    expected_valid[:4, 21] = True
    residual, normed = triton_step.embed_norm(token, embed, norm.weight, norm.variance_epsilon, dtype, valid,
                                              torch.tensor([21], device=DEVICE))
    assert torch.equal(residual, F.embedding(token, embed)) and residual.dtype == torch.float32
    assert torch.equal(valid, expected_valid)
    assert normed.dtype == dtype and _close(normed, _rms_norm(residual, norm).to(dtype), dtype)


def test_advance_moves_the_rows_positions_the_cursor_and_the_step():
    """A step's end in one launch: the first rows' positions (past one block of rows too), the cursor, the step."""
    for rows in (3, triton_step.ADVANCE_BLOCK + 5):
        position = torch.arange(rows + 4, device=DEVICE)
        cursor, step = torch.tensor([30], device=DEVICE), torch.tensor([2], device=DEVICE)
        triton_step.advance(position, rows, cursor, step)
        expected = torch.arange(rows + 4, device=DEVICE)
        expected[:rows] += 1
        assert torch.equal(position, expected) and int(cursor) == 31 and int(step) == 3


def _rotary_inputs(rows: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, generator: torch.Generator):
    """A q|k|v product, rotary tables of 50 positions (``[50, D]`` fp32) and each row's position in them."""
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=generator).to(DEVICE, dtype)
    angles = torch.rand(50, dim // 2, generator=generator) * 6
    angles = torch.cat((angles, angles), dim=-1)
    position = torch.randperm(50, generator=generator)[:rows]
    return qkv, angles.cos().to(DEVICE), angles.sin().to(DEVICE), position.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "head_norms"),
                         [(9, 3, 64, False), (4, 2, 16, True), (8, 1, 32, False)], ids=["smollm2", "qwen3", "mqa"])
def test_rotary_cache_rotates_and_writes_at_the_cursor(dtype, heads, kv_heads, dim, head_norms):
    """The query and key heads normed where the family does, rotated by the tables' rows at each row's position
    as the step's torch code rotates them (the same fp32 operations: without head norms the same bits), the
    query in the attention's dtype; the keys and the values at the cursor's position of cache views with room
    for more, nothing else written."""
    generator = torch.Generator().manual_seed(heads + dim)
    qkv, cos_table, sin_table, position = _rotary_inputs(3, heads, kv_heads, dim, dtype, generator)
    q_norm = _norm(dim, 1e-6, generator) if head_norms else None
    k_norm = _norm(dim, 1e-5, generator) if head_norms else None  # each its own epsilon
    buffer = torch.full((4, kv_heads, 40, dim), 7.0, dtype=dtype, device=DEVICE)
    keys, values = buffer[:3], buffer.clone()[:3]
    cursor = torch.tensor([21], device=DEVICE)
    query = triton_step.rotary_cache(qkv, cos_table, sin_table, position, q_norm, k_norm, keys, values, cursor, dtype,
                                     heads)
    cos, sin = cos_table[position], sin_table[position]  # each row's rotation, at its position
    half = dim // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]
    expected = rotated_query_keys(qkv, heads, kv_heads, q_norm, k_norm, cos[:, None], signed_sin).to(dtype)
    compare = torch.equal if not head_norms else lambda a, b: _close(a, b, dtype)
    assert query.shape == (3, heads, dim) and query.dtype == dtype
    assert compare(query, expected[:, :heads])
    assert compare(keys[:, :, 21], expected[:, heads:])
    assert torch.equal(values[:, :, 21], qkv[:, heads + kv_heads:])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[21] = False
    assert (keys[:, :, untouched] == 7).all() and (values[:, :, untouched] == 7).all() and (buffer[3] == 7).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("inner", [1536, 80], ids=["smollm2", "narrow"])
def test_silu_mul_is_swiglus_activation_times_up(dtype, inner):
    """``silu(gate)`` in the gate's dtype times ``up``, as ``F.silu(gate) * up`` (SmolLM2's 1,536: two blocks)."""
    gate_up = (2 * torch.randn(4, 2 * inner, generator=torch.Generator().manual_seed(inner))).to(DEVICE, dtype)
    out = triton_step.silu_mul(gate_up)
    assert out.shape == (4, inner) and out.dtype == dtype
    assert _close(out, F.silu(gate_up[:, :inner]) * gate_up[:, inner:], dtype)


def _sampling_state(rows: int, vocab: int, generator: torch.Generator) -> StaticKVCache:
    """A static cache's row state at step 3 of a call: rows 0 and 5 already ended, row 2's budget ends now."""
    cache = StaticKVCache(layers=1, kv_heads=1, head_dim=16, rows=rows + 2, length=64, steps=8, kv_dtype=torch.float32,
                          device=torch.device(DEVICE))
    budgets = [8] * rows
    budgets[2] = 4
    cache.begin(rows=rows, width=10, mask=torch.ones(rows, 10), positions=torch.full((rows,), 10), budgets=budgets,
                uniforms=torch.rand(8, rows, generator=generator))
    cache.step.fill_(3)
    cache.done[[0, 5]] = True
    cache.count[:rows] = 3
    cache.token[:rows] = torch.randint(0, vocab, (rows,), generator=generator).to(DEVICE)
    cache.uniforms[3, 6] = 1 - 2**-24
    return cache


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("sample", "temperature"), [(False, 1.0), (True, 1.0), (True, 0.7), (False, 0.0)],
                         ids=["greedy", "sampled", "sampled-T0.7", "greedy-unscaled"])
def test_the_fused_sampling_is_the_static_steps(dtype, sample, temperature):
    """One kernel for the static step's sampling (modeling/triton_step.py:sample_step) against its torch
    operations (graph_decode._sample) on the same row state: the same tokens (greedy: the first largest; drawn:
    the same inverse-CDF draws, the running sums in another order), log-probabilities within fp32's rounding,
    and the same bookkeeping (counted while going, ended by an end token or the budget, the next token)."""
    generator = torch.Generator().manual_seed(int(sample) + int(10 * temperature))
    rows, vocab = 7, 5000  # blocks of 4,096: the last one partial
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(DEVICE, dtype)
    logits[3, 17] = logits[3, 4000] = logits[3].amax() + 1  # a tie: the first is the greedy token
    logits[6, 100:] = float("-inf")  # row 6: 100 tokens of positive probability, drawn at the top of [0, 1)
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature not in (0.0, 1.0) else [])
    drawn = 1.0 if temperature in (0.0, 1.0) else temperature
    states = {}
    for fused in (False, True):
        cache = _sampling_state(rows, vocab, torch.Generator().manual_seed(1))
        greedy_token = int(torch.argmax(logits[3].float()))
        sampling = graph_decode._Sampling(("test",), processors, sample, temperature,
                                          torch.tensor([greedy_token, 4999], device=DEVICE), None,
                                          graph_decode.fused_sampling_temperature(processors, temperature))
        assert sampling.fused_temperature == drawn
        graph_decode._sample(cache, logits, rows, sampling, fused=fused)
        states[fused] = cache
    torch_way, kernel = states[False], states[True]
    assert torch.equal(kernel.tokens, torch_way.tokens) and torch.equal(kernel.token, torch_way.token)
    if not sample:
        assert int(kernel.tokens[3, 3]) == 17
    for name in ("count", "done", "step", "budget"):
        assert torch.equal(getattr(kernel, name), getattr(torch_way, name)), name
    assert bool(kernel.done[2])  # by its budget
    assert bool(kernel.done[3]) or sample  # greedy: by an end token
    assert int(kernel.tokens[6, 3]) < 100  # a draw at the top of [0, 1) takes a token of positive probability
    assert (kernel.log_probs - torch_way.log_probs).abs().amax().item() <= 1e-4


def test_the_fused_sampling_without_end_tokens():
    """A call without end tokens (the benchmarks'): rows end by their budget alone, as torch's sampling ends them."""
    states = {}
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for fused in (False, True):
        cache = _sampling_state(7, 300, torch.Generator().manual_seed(1))
        sampling = graph_decode._Sampling(("test",), LogitsProcessorList(), False, None,
                                          torch.tensor([], dtype=torch.long, device=DEVICE), None, 1.0)
        graph_decode._sample(cache, logits, 7, sampling, fused=fused)
        states[fused] = cache
    for name in ("tokens", "token", "count", "done"):
        assert torch.equal(getattr(states[True], name), getattr(states[False], name)), name
    assert states[True].done[:7].tolist() == [True, False, True, False, False, True, False]


def test_sampling_with_processors_that_sort_stays_torchs():
    """Top-k, top-p and min-p read the sorted scores: the fused sampling does not take them, nor a call scored at
    another temperature than it draws at."""
    assert graph_decode.fused_sampling_temperature(LogitsProcessorList([TopPLogitsWarper(0.9)]), 1.0) is None
    assert graph_decode.fused_sampling_temperature(LogitsProcessorList([TemperatureLogitsWarper(0.7)]), 1.0) is None
    assert graph_decode.fused_sampling_temperature(LogitsProcessorList([]), None) == 1.0
    assert graph_decode.fused_sampling_temperature(LogitsProcessorList([TemperatureLogitsWarper(0.7)]), 0.7) == 0.7


def _models() -> dict[str, torch.nn.Module]:
    """SmolLM2's shape and a Qwen3 (per-head norms of query and key), 2 blocks, small vocabularies, fp32."""
    torch.manual_seed(0)
    smollm2 = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 256}))
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                                         eos_token_id=2, pad_token_id=0))
    for model in (smollm2, qwen3):
        model.eval().requires_grad_(False).to(DEVICE)
        assert use_gqa_attention(model)
    return {"smollm2": smollm2, "qwen3": qwen3}


def _two_turns(model: torch.nn.Module, sample: bool, capture: bool = False) -> list:
    """Two turns of four rows (rows of other lengths and padding, ending on token 2 or their budget); with
    ``capture``, the first block's outputs at the second turn's real positions last."""
    ids = torch.randint(3, 256, (4, 80), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :70] = 0
    cache, common = GrowingKVCache(capture_states=capture), dict(eos_ids={2}, pad_id=0, processors=LogitsProcessorList(),
                                                                 do_sample=sample, log_prob_temperature=1.0)
    torch.manual_seed(5)
    with capture_block_output(model, 0) if capture else contextlib.nullcontext():
        first = decode_batch(model, ids, mask, cache, [12, 4, 12, 8], **common)
        where = {row: k for k, row in enumerate(first.cache_rows)}
        cache.batch_select_indices(torch.tensor([where[row] for row in range(4)], device=DEVICE))
        extra = torch.randint(3, 256, (4, 70), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        second = decode_batch(model, torch.cat([first.ids, extra], 1),
                              torch.cat([first.mask, torch.ones_like(extra)], 1), cache, [8] * 4, **common)
    runs = [(run.tokens, run.log_probs) for run in (first, second)]
    if capture:
        where = {row: k for k, row in enumerate(second.cache_rows)}
        runs.append(cache.states.states[[where[row] for row in range(4)]][second.mask.bool()].float())
    return runs


@pytest.mark.skipif(not INTERPRETED, reason="the CPU's static step, through the interpreter (the GPU's: "
                    "test_modeling_graph_decode_cuda.py)")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_static_step_with_the_kernels_gives_torchs_tokens(sample, attention, monkeypatch):
    """SmolLM2's shape and a Qwen3 in fp32 on the CPU, the static step forced on, with either attention: two
    turns with the fused kernels and with torch's operations give the same tokens, log-probabilities within
    fp32's rounding, and the kernels ran where chosen, and only there."""
    monkeypatch.setattr(static_cache, "STATIC_DECODE", "on")
    monkeypatch.setattr(static_cache, "DECODE_ATTENTION", attention)
    calls = collections.Counter()
    for name in ("embed_norm", "residual_norm", "rotary_cache", "silu_mul", "advance"):
        kernel = getattr(triton_step, name)
        monkeypatch.setattr(triton_step, name, lambda *a, _k=kernel, _n=name, **kw: calls.update([_n]) or _k(*a, **kw))
    for name, model in _models().items():
        runs = {}
        for kernels in ("aten", "triton"):
            monkeypatch.setattr(static_cache, "DECODE_KERNELS", kernels)
            assert decoding_path("cpu", False)["decode.kernels"] == kernels
            runs[kernels] = _two_turns(model, sample)
            assert (sum(calls.values()) > 0) == (kernels == "triton"), name
            if kernels == "triton":  # per step of 2 blocks: 1 start, 2 norms a block, a rotation and an
                steps = calls["embed_norm"]  # activation a block, 1 advance (the sampling: where it is fused)
                assert calls["residual_norm"] == 4 * steps and calls["rotary_cache"] == calls["silu_mul"] == 2 * steps
                assert calls["advance"] == steps > 0, calls
            calls.clear()
        assert [run[0] for run in runs["triton"]] == [run[0] for run in runs["aten"]], name
        assert max(change for _, change in parting(runs["triton"], runs["aten"])) <= 1e-4, name


@pytest.mark.skipif(not INTERPRETED, reason="the CPU's static step, through the interpreter (the GPU's: "
                    "test_modeling_graph_decode_cuda.py)")
def test_the_boundary_states_with_the_kernels_are_torchs(monkeypatch):
    """The native trainer's boundary states (a block's output at every position, the decoded ones written by
    the static step) with the fused kernels: the residual stream they update in place, as torch's operations
    leave it, within fp32's rounding (SmolLM2's shape, greedy, the same tokens)."""
    monkeypatch.setattr(static_cache, "STATIC_DECODE", "on")
    model = _models()["smollm2"]
    runs = {}
    for kernels in ("aten", "triton"):
        monkeypatch.setattr(static_cache, "DECODE_KERNELS", kernels)
        runs[kernels] = _two_turns(model, False, capture=True)
    assert [run[0] for run in runs["triton"][:2]] == [run[0] for run in runs["aten"][:2]]
    fused, plain = runs["triton"][2], runs["aten"][2]
    assert fused.shape == plain.shape and (fused - plain).abs().amax().item() <= 1e-5 * plain.abs().amax().item()


KERNELS_AHEAD_OF_TIME = """
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spader_pipeline.modeling import triton_step_kernels as kernels
# as the static step launches them on CUDA under autocast: SmolLM2 (width 576, 9 + 3 heads of 64 without head
# norms, SwiGLU 1,536, 49,152 tokens) and Qwen3-8B (4,096, 32 + 8 heads of 128 with head norms, 12,288, 151,936)
TYPES = {
    "residual_norm_kernel": {"residual": "*fp32", "delta": "*bf16", "weight": "*fp32", "normed": "*bf16",
                             "eps": "fp32"},
    "embed_norm_kernel": {"token": "*i64", "embed": "*fp32", "weight": "*fp32", "residual": "*fp32", "normed": "*bf16",
                          "valid": "*u8", "cursor": "*i64", "eps": "fp32"},
    "rotary_cache_kernel": {"qkv": "*bf16", "cos": "*fp32", "sin": "*fp32", "position": "*i64", "q_weight": "*fp32",
                            "k_weight": "*fp32", "query": "*bf16", "keys": "*bf16", "values": "*bf16", "cursor": "*i64",
                            "q_eps": "fp32", "k_eps": "fp32"},
    "silu_mul_kernel": {"gate_up": "*bf16", "out": "*bf16"},
    "sample_kernel": {"logits": "*bf16", "uniforms": "*fp32", "step": "*i64", "eos": "*i64", "budget": "*i64",
                      "done": "*u8", "count": "*i64", "token": "*i64", "tokens": "*i64", "log_probs": "*fp32",
                      "temperature": "fp32"},
    "advance_kernel": {"position": "*i64", "cursor": "*i64", "step": "*i64"},
}


def launches(width, heads, kv_heads, dim, inner, vocab, head_norms):
    # each kernel's constants and warps as triton_step launches them for a model of these sizes
    pad = lambda n: 1 << (n - 1).bit_length()
    return {"residual_norm_kernel": ({"WIDTH": width, "BLOCK": pad(width), "HAS_DELTA": True},
                                     4 if pad(width) <= 2048 else 8),
            "embed_norm_kernel": ({"WIDTH": width, "BLOCK": pad(width)}, 4 if pad(width) <= 2048 else 8),
            "rotary_cache_kernel": ({"HEADS": heads, "KV_HEADS": kv_heads, "HEADS_PAD": pad(heads),
                                     "KV_PAD": pad(kv_heads), "DIM": dim, "HEAD_NORMS": head_norms}, 4),
            "silu_mul_kernel": ({"INNER": inner, "BLOCK": min(1024, pad(inner))}, 4),
            "sample_kernel": ({"VOCAB": vocab, "BLOCK": min(4096, pad(vocab)), "DO_SAMPLE": True, "LOG_PROBS": True,
                               "EOS_COUNT": 2, "EOS_PAD": 2}, 8),
            "advance_kernel": ({"BLOCK": 1024}, 4)}


SHAPES = {"smollm2": launches(576, 9, 3, 64, 1536, 49152, False),
          "qwen3_8b": launches(4096, 32, 8, 128, 12288, 151936, True)}
built = {}
for model, launches in SHAPES.items():
    for name, (values, warps) in launches.items():
        kernel = getattr(kernels, name)
        names = list(inspect.signature(kernel.fn).parameters)
        signature = {n: TYPES[name].get(n, "constexpr" if n in values else "i32") for n in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(k),): v for k, v in values.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        built[f"{model}/{name}"] = {"fma": ptx.count("fma.rn.f32"), "bytes": len(ptx)}
print(json.dumps(built))
"""


def test_the_kernels_build_for_hopper_without_fused_multiply_adds():
    """Triton's own compiler, ahead of time for sm_90 (the H200's; no GPU needed, so a CPU checks it before a
    lease), at the static step's shapes for SmolLM2 and for Qwen3-8B (the reference setup's model): each kernel
    builds, and the rotation sums no product in one rounding (the launches turn that fusion off: its
    ``x·cos + y·sin`` rounds as torch's)."""
    import json
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # the real compiler
    done = subprocess.run([sys.executable, "-c", KERNELS_AHEAD_OF_TIME], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(built) == {f"{model}/{name}" for model in ("smollm2", "qwen3_8b")
                          for name in ("residual_norm_kernel", "embed_norm_kernel", "rotary_cache_kernel", "silu_mul_kernel",
                                       "sample_kernel", "advance_kernel")}
    assert built["smollm2/rotary_cache_kernel"]["fma"] == 0 and built["qwen3_8b/rotary_cache_kernel"]["fma"] == 0, built
