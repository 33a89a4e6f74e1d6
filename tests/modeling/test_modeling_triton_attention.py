"""The decoding step's attention as one Triton kernel (modeling/triton_attention.py): fp32 attention's result
over the positions each row holds, up to the step's last one and not past it, over cache views with room
for more positions; and the static step with it gives SDPA's tokens.

Where Triton runs: a CUDA GPU, or a CPU with Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is
imported; ``gpu_issue63.sh rehearse`` runs these so in the GPU machine's torch). CI's CPU torch has no
Triton: these skip there. The interpreter's products of bf16 tiles are wrong (it multiplies their bits), so
there the kernel is checked in fp16 and fp32; on a GPU in bf16 too."""

from __future__ import annotations

import os

import pytest
import torch
from decoding_runs import SMOLLM2_135M, parting
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from spader_pipeline.modeling import graph_decode, static_cache, triton_attention
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.decode_step import decoding_path
from spader_pipeline.modeling.kv_cache import GrowingKVCache

pytestmark = pytest.mark.skipif(not triton_attention.available(),
                                reason="needs Triton: a CUDA GPU, or its interpreter (TRITON_INTERPRET=1)")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
#: the largest difference from fp32 attention by the inputs' dtype: the probabilities are cast to it before
#: their product with the values (flash attention's rounding)
BOUNDS = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


def _inputs(rows: int, length: int, group: int, dtype: torch.dtype, generator: torch.Generator):
    """query ``[rows, 3, group, 64]``; keys and values views ``[rows, 3, length, 64]`` of buffers 32 positions
    longer; every position held but row 0's first 70 (a whole block with nothing held) and row 1's 30-39."""

    def cache() -> torch.Tensor:
        return torch.randn(rows, 3, length + 32, 64, generator=generator).to(DEVICE, dtype)[:, :, :length]

    query = torch.randn(rows, 3, group, 64, generator=generator).to(DEVICE, dtype)
    valid = torch.ones(rows, length, dtype=torch.bool, device=DEVICE)
    valid[0, :70] = False
    if rows > 1:
        valid[1, 30:40] = False
    return query, cache(), cache(), valid


def _fp32_attention(query, keys, values, valid, end: int, scale: float) -> torch.Tensor:
    held = valid.clone()
    held[:, end:] = False
    scores = query.float() @ keys.float().transpose(-1, -2) * scale
    scores = scores.masked_fill(~held[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ values.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("rows", "length", "end", "group"),
                         [(3, 192, 150, 3), (2, 128, 128, 4), (1, 128, 90, 1), (2, 256, 129, 16)])
def test_the_kernel_is_fp32_attention_over_the_held_positions(rows, length, end, group, dtype):
    query, keys, values, valid = _inputs(rows, length, group, dtype, torch.Generator().manual_seed(rows + end))
    out = triton_attention.grouped_decode_attention(query, keys, values, valid, torch.tensor([end], device=DEVICE),
                                                    0.125)
    assert out.shape == query.shape and out.dtype == dtype
    expected = _fp32_attention(query, keys, values, valid, end, 0.125)
    assert (out.float() - expected).abs().amax().item() <= BOUNDS[dtype]


@pytest.mark.parametrize("dtype", DTYPES[:1] + DTYPES[2:], ids=lambda d: str(d).removeprefix("torch."))
def test_the_loop_over_the_length_attends_the_same_positions(dtype):
    """The benchmark's variant (a loop over the view's length, the blocks past ``end`` masked) gives the loop
    up to ``end``'s result (one shape: each length is a kernel of its own)."""
    query, keys, values, valid = _inputs(3, 192, 3, dtype, torch.Generator().manual_seed(7))
    end = torch.tensor([150], device=DEVICE)
    to_end = triton_attention.grouped_decode_attention(query, keys, values, valid, end, 0.125)
    over = triton_attention.grouped_decode_attention(query, keys, values, valid, end, 0.125, over_length=True)
    assert (over.float() - to_end.float()).abs().amax().item() <= BOUNDS[dtype]


@pytest.mark.parametrize("over_length", [False, True], ids=["to-end", "over-length"])
def test_no_position_past_the_end_is_read(over_length):  # fp32: the same kernels as the fp32 case above
    """Keys and values past ``end`` are NaN: a kernel that read them would carry a NaN into every row."""
    query, keys, values, valid = _inputs(2, 192, 3, torch.float32, torch.Generator().manual_seed(3))
    keys[:, :, 100:] = float("nan")
    values[:, :, 100:] = float("nan")
    out = triton_attention.grouped_decode_attention(query, keys, values, valid, torch.tensor([100], device=DEVICE),
                                                    0.125, over_length=over_length)
    assert torch.isfinite(out).all()
    expected = _fp32_attention(query, keys[:, :, :100], values[:, :, :100], valid[:, :100], 100, 0.125)
    assert (out - expected).abs().amax().item() <= 1e-5


@pytest.mark.parametrize(("block", "warps", "stages"), [(32, 4, 3), (128, 8, 4), (64, 2, 2)])
def test_another_launch_gives_the_same_attention(block, warps, stages):
    """The attention benchmark's other launches (positions an iteration, warps, pipelining stages) compute
    the same attention (fp32: the interpreter runs the block size, not the warps or stages)."""
    query, keys, values, valid = _inputs(3, 192, 3, torch.float32, torch.Generator().manual_seed(11))
    end = torch.tensor([150], device=DEVICE)
    out = triton_attention.grouped_decode_attention(query, keys, values, valid, end, 0.125, block=block, warps=warps,
                                                    stages=stages)
    assert (out - _fp32_attention(query, keys, values, valid, 150, 0.125)).abs().amax().item() <= 1e-5


def test_no_position_before_a_rows_first_is_read():
    """With ``first`` (each row's first held position: a right-aligned row's left padding ends there), the
    blocks wholly before it are skipped: NaN keys and values there reach no row, and the attention is the
    same as over every held position."""
    query, keys, values, valid = _inputs(3, 192, 3, torch.float32, torch.Generator().manual_seed(5))
    valid[2, :130] = False  # row 2: two whole blocks of left padding and part of a third
    first = valid.to(torch.uint8).argmax(dim=1)
    expected = _fp32_attention(query, keys, values, valid, 180, 0.125)
    for row in range(3):
        keys[row, :, : int(first[row]) // 64 * 64] = float("nan")
        values[row, :, : int(first[row]) // 64 * 64] = float("nan")
    out = triton_attention.grouped_decode_attention(query, keys, values, valid, torch.tensor([180], device=DEVICE),
                                                    0.125, first=first)
    assert int(first[0]) == 70 and int(first[2]) == 130 and torch.isfinite(out).all()
    assert (out - expected).abs().amax().item() <= 1e-5


def test_shapes_it_does_not_take_are_refused():
    query, keys, values, valid = _inputs(1, 128, 3, torch.float32, torch.Generator().manual_seed(0))
    assert triton_attention.fits(3, 64) and not triton_attention.fits(3, 8) and not triton_attention.fits(17, 64)
    with pytest.raises(ValueError, match="head dim"):
        triton_attention.grouped_decode_attention(query[..., :8], keys[..., :8], values[..., :8], valid,
                                                  torch.tensor([128], device=DEVICE), 0.125)


@pytest.mark.skipif(not INTERPRETED, reason="the CPU's static step, through the interpreter (the GPU's: "
                    "test_modeling_graph_decode_cuda.py)")
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_static_step_with_the_kernel_gives_sdpas_tokens(sample, monkeypatch):
    """SmolLM2's attention shape (2 blocks, a small vocabulary) in fp32 on the CPU, the static step forced on:
    two turns (rows of different lengths and padding, ending on token 2 or their budget) with the kernel and
    with SDPA give the same tokens, log-probabilities within fp32's rounding."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 256})).eval()
    model.requires_grad_(False)
    assert use_gqa_attention(model)
    monkeypatch.setattr(static_cache, "STATIC_DECODE", "on")
    calls = []
    kernel = graph_decode.grouped_decode_attention
    monkeypatch.setattr(graph_decode, "grouped_decode_attention", lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    runs = {}
    for way in ("sdpa", "triton"):
        monkeypatch.setattr(static_cache, "DECODE_ATTENTION", way)
        assert decoding_path("cpu", False)["decode.attention"] == way
        ids = torch.randint(3, 256, (4, 80), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :70] = 0  # a whole block of left padding, which the kernel skips (``first``)
        cache, common = GrowingKVCache(), dict(eos_ids={2}, pad_id=0, processors=LogitsProcessorList(),
                                               do_sample=sample, log_prob_temperature=1.0)
        torch.manual_seed(5)
        first = decode_batch(model, ids, mask, cache, [12, 4, 12, 8], **common)
        where = {row: k for k, row in enumerate(first.cache_rows)}
        cache.batch_select_indices(torch.tensor([where[row] for row in range(4)]))
        extra = torch.randint(3, 256, (4, 70), generator=torch.Generator().manual_seed(1))
        second = decode_batch(model, torch.cat([first.ids, extra], 1), torch.cat([first.mask, torch.ones_like(extra)], 1),
                              cache, [8] * 4, **common)
        runs[way] = [(run.tokens, run.log_probs) for run in (first, second)]
        assert bool(calls) == (way == "triton")  # the kernel decoded where chosen, and only there
        calls.clear()
    assert [run[0] for run in runs["triton"]] == [run[0] for run in runs["sdpa"]]
    assert max(change for _, change in parting(runs["triton"], runs["sdpa"])) <= 1e-5


AHEAD_OF_TIME = """
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spader_pipeline.modeling.triton_decode_kernel import decode_attention_kernel as kernel
names = list(inspect.signature(kernel.fn).parameters)
pointers, constants = {"query", "keys", "values", "out"}, {"GROUP", "GROUP_PAD", "DIM", "BLOCK", "LENGTH",
                                                           "PRECISION", "INTERPRETED", "HAS_FIRST"}
signature = {name: "*bf16" if name in pointers else "*u8" if name == "valid" else "*i64" if name in ("end", "first")
             else "fp32" if name == "scale" else "constexpr" if name in constants else "i32" for name in names}
# as a launch specialises them: pointers and the strides (multiples of 16 here) divisible by 16
aligned = [name for name in names if signature[name] in ("*bf16", "*u8", "*i64", "i32") and name != "query_group"]
built = {}
for block, warps, stages in LAUNCHES:
    values = {"GROUP": 3, "GROUP_PAD": 16, "DIM": 64, "BLOCK": block, "LENGTH": 0, "PRECISION": None,
              "INTERPRETED": False, "HAS_FIRST": True}  # as the static step launches it
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in values.items()},
                       attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps, "num_stages": stages}).asm["ptx"]
    built[f"{block}/{warps}/{stages}"] = {"mma": "mma.sync" in ptx or "wgmma" in ptx,
                                          "async_copies": ptx.count("cp.async")}
print(json.dumps(built))
"""
#: (block, warps, stages): the step's launch first, then the attention benchmark's others
LAUNCHES = [(64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 2, 3), (64, 8, 3), (64, 4, 2), (64, 4, 4)]


def test_the_kernel_builds_for_hopper_with_tensor_cores_and_pipelined_loads():
    """Triton's own compiler, ahead of time for sm_90 (the H200's; no GPU needed, so a CPU checks it before a
    lease), at the step's launch and the attention benchmark's others: bf16 products on the tensor cores, and
    the loop's loads asynchronous copies (pipelined), which a while loop over the same blocks would not be."""
    import json
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # the real compiler
    script = f"LAUNCHES = {LAUNCHES!r}\n" + AHEAD_OF_TIME
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(built) == len(LAUNCHES)
    for launch, ptx in built.items():
        assert ptx["mma"], launch
        assert ptx["async_copies"] > 0 or launch.endswith("/1"), launch
