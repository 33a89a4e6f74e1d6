"""The static decoding step (modeling/graph_decode.py over modeling/static_cache.py) run on the CPU, where it
is forced on (``STATIC_DECODE = "on"``) and launched op by op: the host loop's tokens and log-probabilities
on the tests' tiny models and SmolLM2's shape, greedy and seeded, over continued turns with ended rows,
padding and the boundary capture; the capture path (a stand-in for ``torch.cuda.graph``) once per bucket;
no read from the device inside a step; the cache living in the static buffers, moved out for another batch
and into a larger allocation; and where it steps aside. The CUDA graphs themselves:
test_modeling_graph_decode_cuda.py."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from decoding_runs import SMOLLM2_135M, parting
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

from spader_pipeline.modeling import graph_decode, packed_linear, static_cache
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.boundary import capture_block_output
from spader_pipeline.modeling.decode import decode_batch
from spader_pipeline.modeling.decode_attention import bf16_decode_attention_available
from spader_pipeline.modeling.decode_step import decoding_path
from spader_pipeline.modeling.graph_decode import static_decode_stats, static_decoder
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.packed_linear import packing_available
from spader_pipeline.modeling.precision import bf16_inference

#: fp32 (no autocast): the static step's attention is one SDPA call per key/value head over its group of query
#: heads, the host loop's one call with ``enable_gqa``: the same products summed in another order
FP32_BOUND = 1e-5
#: SmolLM2's shape under bf16 autocast: the largest change of a log-probability up to where two runs part (a
#: logit's last bf16 bit deciding a token), as between the C++ step and SDPA (test_modeling_decoding_path.py)
LOG_PROB_BOUND = 0.05


def _static(on: bool, monkeypatch) -> None:
    monkeypatch.setattr(static_cache, "STATIC_DECODE", "on" if on else "off")


def _decode(model, *, sample: bool, bf16: bool, capture: bool = False, budgets=(12, 4, 12, 8), width: int = 9,
            processors=None):
    """Two turns of decode_batch for 4 rows (one padded; rows ending on token 2 or their budget) from seed 5,
    the cache's rows put back in input order between them as the decoding engine does: per turn the tokens,
    log-probabilities, ids and mask; the states at the real positions (``capture``) and the generator's next
    draw."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (4, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = GrowingKVCache(capture_states=capture)
    torch.manual_seed(5)
    common = dict(eos_ids={2}, pad_id=0, processors=processors or LogitsProcessorList(), do_sample=sample,
                  log_prob_temperature=1.0)
    with bf16_inference(model, "cpu", bf16), capture_block_output(model, 0) if capture else contextlib.nullcontext():
        first = decode_batch(model, ids, mask, cache, list(budgets), **common)
        where = {row: k for k, row in enumerate(first.cache_rows)}
        cache.batch_select_indices(torch.tensor([where[row] for row in range(4)]))
        extra = torch.randint(3, vocab, (4, 3), generator=torch.Generator().manual_seed(1))
        second = decode_batch(model, torch.cat([first.ids, extra], 1), torch.cat([first.mask, torch.ones_like(extra)], 1),
                              cache, [8] * 4, **common)
    runs = [(run.tokens, run.log_probs, run.ids.tolist(), run.mask.tolist()) for run in (first, second)]
    states = None
    if capture:
        where = {row: k for k, row in enumerate(second.cache_rows)}
        in_order = cache.states.states[[where[row] for row in range(4)]]
        states = in_order[second.mask.bool()]
    return runs, states, torch.rand(4)


@pytest.fixture(params=["packed", "unpacked"])
def host_products(request, monkeypatch) -> str:
    """The host loop's products with oneDNN's packed weights (a CPU with a bf16 unit: the C++ step's and
    :class:`FusedDecodeStep`'s, or each module's packed weight) and without (autocast's own products, as a
    CPU without one computes them): the static step takes the same products either way."""
    if request.param == "packed":
        if not packing_available():
            pytest.skip("no bf16 unit or no oneDNN packing here")
        assert decoding_path("cpu", True)["decode.packed_weights"] == "on"
    else:
        monkeypatch.setattr(packed_linear, "PACK_WEIGHTS", False)
    return request.param


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_under_bf16_autocast_the_static_step_is_the_host_loops_bit_for_bit(tiny_model, sample, host_products,
                                                                          monkeypatch):
    """The CPU's decoding under autocast, op for op (the host loop's own products from the same bf16 values,
    the CPU's fp32 attention over the same bf16 cache, the same draws from the same uniform numbers): the
    same floats. The tiny models' products are narrow enough that one product over q|k|v is not each
    module's bit for bit (oneDNN and ATen pick their kernels by the shape), so this holds only because the
    static step takes the host loop's products on the CPU (graph_decode.PRODUCTS)."""
    _static(False, monkeypatch)
    host = _decode(tiny_model, sample=sample, bf16=True)
    _static(True, monkeypatch)
    steps = static_decode_stats()["eager_steps"]
    static = _decode(tiny_model, sample=sample, bf16=True)
    assert static_decode_stats()["eager_steps"] > steps  # the static step ran
    assert static[0] == host[0]  # ==: tokens, log-probabilities, ids, masks
    assert torch.equal(static[2], host[2])  # the generator left where the host loop leaves it


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_in_fp32_the_static_step_gives_the_host_loops_tokens(tiny_model, sample, monkeypatch):
    _static(False, monkeypatch)
    host = _decode(tiny_model, sample=sample, bf16=False)
    _static(True, monkeypatch)
    static = _decode(tiny_model, sample=sample, bf16=False)
    assert [run[0] for run in static[0]] == [run[0] for run in host[0]]
    assert [run[2:] for run in static[0]] == [run[2:] for run in host[0]]
    assert max(change for _, change in parting(static[0], host[0])) <= FP32_BOUND


def test_the_boundary_states_are_the_host_loops(tiny_model, host_products, monkeypatch):
    """The states the update starts from, at every real position of both turns: the block's output as the
    fused step and the hook record it."""
    _static(False, monkeypatch)
    host = _decode(tiny_model, sample=False, bf16=True, capture=True)
    _static(True, monkeypatch)
    static = _decode(tiny_model, sample=False, bf16=True, capture=True)
    assert static[0] == host[0] and torch.equal(static[1], host[1])
    assert static[1].shape[0] == sum(map(sum, host[0][1][3]))


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_on_smollm2s_shape_the_static_step_is_the_host_loops(sample, monkeypatch):
    """SmolLM2's shape (random weights) under bf16 autocast. The static step attends over its length bucket
    (the real positions and a masked tail), the host loop over exactly the positions written. The native
    attention's sums do not depend on a masked tail (its softmax rows are at least a vector register wide), so
    the static step is the host loop's bit for bit. Where the attention is fp32 SDPA (no C++ compiler), a
    masked tail changes the order of its sums, so a bf16 value computed from them can round to its neighbour:
    the greedy tokens are the same and the log-probabilities within :data:`LOG_PROB_BOUND`; sampled from random
    weights, every draw is from a near-uniform distribution over 49,152 tokens, so a row parts within a few
    tokens (as between the C++ step and SDPA, test_modeling_decoding_path.py), the log-probabilities within
    the bound up to there. Over exactly the written positions it is bit for bit either way."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval().requires_grad_(False)
    assert use_gqa_attention(model)
    _static(False, monkeypatch)
    host = _decode(model, sample=sample, bf16=True)
    _static(True, monkeypatch)
    static = _decode(model, sample=sample, bf16=True)
    if bf16_decode_attention_available():
        assert static[0] == host[0]
        return
    shared = parting(static[0], host[0])
    assert max(change for _, change in shared) <= LOG_PROB_BOUND
    tokens = sum(len(row) for run in host[0] for row in run[0])
    assert sum(same for same, _ in shared) >= (tokens if not sample else 1)
    monkeypatch.setattr(graph_decode, "length_bucket", lambda length, limit: length)  # exactly the written positions
    assert _decode(model, sample=sample, bf16=True)[0] == host[0]


def _edit_in_place(model) -> None:
    with torch.no_grad():
        model.model.layers[-1].mlp.up_proj.weight.mul_(1.5)
        model.model.layers[0].self_attn.k_proj.weight.add_(0.05)


def _adamw_step(foreach: bool):
    """The native trainer's AdamW (``fused=False``; ``foreach`` on CUDA, a for-loop on the CPU)."""
    def step(model) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=foreach, fused=False)
        for parameter in model.parameters():
            parameter.grad = torch.full_like(parameter, 0.1)
        optimizer.step()
    return step


@pytest.mark.parametrize("write", [_edit_in_place, _adamw_step(True), _adamw_step(False)],
                         ids=["in-place", "adamw-foreach", "adamw-for-loop"])
def test_a_weight_written_in_place_reaches_the_next_call(tiny_model, write, monkeypatch):
    """An optimiser step or a weight sync writes in place, bumping the version counters the bf16 copies are
    refreshed by: they are made again (in place: a captured graph reads them where they were). (torch's fused
    AdamW bumps none: a decoding call after its step would read the weights from before it.)"""
    _static(True, monkeypatch)
    before = _decode(tiny_model, sample=False, bf16=True)
    write(tiny_model)
    static = _decode(tiny_model, sample=False, bf16=True)
    _static(False, monkeypatch)
    assert static[0] == _decode(tiny_model, sample=False, bf16=True)[0] != before[0]


def test_the_capture_path_captures_each_bucket_once_and_replays_it(tiny_model, monkeypatch):
    """The CUDA path's logic on the CPU: a stand-in for ``torch.cuda.graph`` records the step (running nothing,
    as a capture runs nothing) and replays it. A bucket's first step runs eagerly and is captured; its later
    steps replay; a second call of the same shapes captures nothing; the tokens are the eager step's."""
    captured = []

    class Recorded:
        def __init__(self, step):
            self.step = step

        def replay(self):
            self.step()

    monkeypatch.setattr(graph_decode, "_use_graphs", lambda device: True)
    monkeypatch.setattr(graph_decode, "_cuda_graph",
                        lambda step, pool, stream: captured.append((step, stream)) or Recorded(step))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    _static(True, monkeypatch)
    before = static_decode_stats()
    replayed = [_decode(tiny_model, sample=sample, bf16=True)[0] for sample in (False, True)]
    after = static_decode_stats()
    runners = next(iter(graph_decode._DECODERS[tiny_model].values())).runners
    assert len(captured) == after["captures"] - before["captures"] == len(runners)
    assert after["buckets"] - before["buckets"] == len(runners)  # each bucket's step built once, and captured
    assert {(4, 256), (2, 256)} <= {key[:2] for key in runners}  # rows of the going rows' bucket, positions'
    assert after["replays"] > before["replays"]
    _decode(tiny_model, sample=False, bf16=True)
    assert static_decode_stats()["captures"] == after["captures"]  # the same buckets: nothing captured again
    _decode(tiny_model, sample=False, bf16=False)  # another precision: another decoder, capturing on its own stream
    decoders = list(graph_decode._DECODERS[tiny_model].values())
    streams = {id(stream) for _, stream in captured}
    assert len(decoders) == 2 and streams == {id(d.capture_stream) for d in decoders} and len(streams) == 2
    monkeypatch.setattr(graph_decode, "_use_graphs", lambda device: False)
    replays = static_decode_stats()["replays"]
    assert [_decode(tiny_model, sample=sample, bf16=True)[0] for sample in (False, True)] == replayed
    assert static_decode_stats()["replays"] == replays  # graphs off: the step op by op, not the captured buckets


#: operations that return their input's storage without being views by their schema: no kernel
_NO_KERNEL = ("detach", "alias", "_unsafe_view", "_reshape_alias")


class _Operations(TorchDispatchMode):
    """Counts the ATen operations run under it, views not counted (they launch nothing), a norm passed through
    :class:`_OneNormCall` as one: on CUDA ``torch.rms_norm`` is one kernel, on the CPU several operations."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.inside_norm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside_norm and not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.counts[func.overloadpacket.__name__] += 1
        return out


class _OneNormCall(TorchFunctionMode):
    def __init__(self, operations: _Operations) -> None:
        super().__init__()
        self.operations = operations

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.rms_norm:
            return func(*args, **(kwargs or {}))
        self.operations.counts["rms_norm"] += 1
        self.operations.inside_norm += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.operations.inside_norm -= 1


#: operations that allocate without launching a kernel
_ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty")


def _stand_in_kernels(operations: _Operations, monkeypatch) -> None:
    """Stands in for the fused Triton kernels (modeling/triton_step.py; CI's torch has no Triton) until the test
    ends: each call a launch counted under ``triton:<name>``, its outputs allocated as the kernel's wrapper
    allocates them."""
    from spader_pipeline.modeling import triton_step

    def launched(name, result):
        def kernel(*args, **kwargs):
            operations.counts[f"triton:{name}"] += 1
            return result(*args, **kwargs)
        return kernel

    patches = {
        "embed_norm": lambda token, embed, weight, eps, dtype, valid, cursor: (
            torch.empty(token.shape[0], embed.shape[1], dtype=embed.dtype),
            torch.empty(token.shape[0], embed.shape[1], dtype=dtype)),
        "residual_norm": lambda residual, delta, weight, eps, dtype: torch.empty(residual.shape, dtype=dtype),
        "rotary_cache": lambda qkv, cos, sin, position, qn, kn, keys, values, cursor, dtype, heads: torch.empty(
            qkv.shape[0], heads, qkv.shape[2], dtype=dtype),
        "silu_mul": lambda gate_up: torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype),
        "sample_step": lambda logits, **buffers: None,
        "advance": lambda position, rows, cursor, step: None,
    }
    for name, result in patches.items():
        monkeypatch.setattr(triton_step, name, launched(name, result))


def _step_operations(blocks: int, kernels: str = "aten", monkeypatch=None) -> int:
    """The operations of one step and its sampling as built for CUDA under bf16 autocast (its norms, products
    and attention; run here on the CPU's tensors), SmolLM2's block with ``blocks`` blocks, 8 rows; ``kernels``
    ``triton``: with the fused kernels (:func:`_stand_in_kernels`), each counted as one launch."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": blocks, "vocab_size": 512})).eval()
    precision = graph_decode._Precision(torch.bfloat16, torch.float32, torch.bfloat16, False, torch.bfloat16)
    step = graph_decode._Step(model, precision, torch.device("cuda"))
    rows, config = 8, model.config
    cache = static_cache.StaticKVCache(layers=blocks, kv_heads=config.num_key_value_heads,
                                       head_dim=config.hidden_size // config.num_attention_heads, rows=rows,
                                       length=256, steps=8, kv_dtype=torch.bfloat16, device="cpu")
    cache.begin(rows=rows, width=100, mask=torch.ones(rows, 100), positions=torch.full((rows,), 100),
                budgets=[8] * rows, uniforms=None)
    sampling = graph_decode._Sampling(("greedy",), lambda ids, scores: scores, False, 1.0, torch.tensor([2]), None,
                                      fused_temperature=1.0)
    operations = _Operations()
    if kernels == "triton":
        _stand_in_kernels(operations, monkeypatch)
    step.rotary_tables(cache.length)  # as the runner makes them, before its capture
    with torch.no_grad(), _OneNormCall(operations), operations:
        graph_decode.decoding_step(step, cache, rows, 256, sampling, "sdpa", kernels)
    return sum(count for name, count in operations.counts.items() if name not in _ALLOCATIONS)


def test_a_step_on_cuda_is_twenty_operations_a_block():
    """At 1-8 rows a step's time is its kernels' count more than its bytes (docs/gpu.md), and a captured graph
    still launches them one after the other. A block: its two norms, the q|k|v, output, gate|up and down
    products, the rotation, the key and value writes, the attention, SwiGLU, two residual adds and the casts
    of the products' inputs (20); the step around the blocks (embedding, its rows' rotary values read from the
    tables, mask, final norm, head, sampling, advance) 33. SmolLM2's 30 blocks: 633 operations a step."""
    two, three = _step_operations(2), _step_operations(3)
    per_block = three - two
    assert per_block <= 20, per_block
    assert two - 2 * per_block <= 33, two - 2 * per_block


def test_with_the_fused_kernels_a_block_is_nine_launches(monkeypatch):
    """With ``SPADER_DECODE_KERNELS=triton`` a block is its four products, the attention and four fused kernels
    (the add and norm twice, the rotation with the cache's writes, SwiGLU's activation), and around the blocks
    five: the embedding with the position's mark and the first norm, the mask, the head, the sampling, the
    advance (33 with torch's): SmolLM2's 30 blocks 275 launches a step where torch's operations take 633."""
    two, three = _step_operations(2, "triton", monkeypatch), _step_operations(3, "triton", monkeypatch)
    per_block = three - two
    assert per_block <= 9, per_block
    assert two - 2 * per_block <= 5, two - 2 * per_block
    assert per_block <= _step_operations(3) - _step_operations(2) - 11


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_with_the_triton_attention_one_graph_a_row_bucket_serves_every_length(attention, monkeypatch):
    """SDPA reads the whole view a step attends over, so its graphs are per length bucket (of 256 positions);
    the Triton attention reads each row's positions up to the cursor whatever the view, so its step attends
    over the whole allocation, one graph per row bucket however long the turn grows."""
    from spader_pipeline.modeling import triton_attention

    monkeypatch.setattr(triton_attention, "available", lambda: True)  # launched nowhere here: the choice alone
    monkeypatch.setattr(static_cache, "DECODE_ATTENTION", attention)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": 1, "vocab_size": 64})).eval()
    precision = graph_decode._Precision(torch.bfloat16, torch.float32, torch.bfloat16, False, torch.bfloat16)
    decoder = graph_decode._Decoder(model, precision, torch.device("cpu"))
    decoder.cache = static_cache.StaticKVCache(layers=1, kv_heads=3, head_dim=64, rows=8, length=1024, steps=64,
                                               kv_dtype=torch.bfloat16, device="cpu")
    assert decoder.attention() == attention
    lengths = {decoder.step_length(cursor) for cursor in (100, 300, 700, 1000)}
    assert lengths == ({1024} if attention == "triton" else {256, 512, 768, 1024})


def test_a_step_reads_nothing_from_the_device(tiny_model, monkeypatch):
    """Inside a window of steps nothing reads a tensor's value on the host (on CUDA each would wait for the
    device): ``item``, ``tolist``, truth values and conversions raise there. The reads between windows (which
    rows ended) stay outside."""
    def refuse(*args, **kwargs):
        raise AssertionError("a decoding step read a tensor on the host")

    @contextlib.contextmanager
    def no_reads(device):
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
                patch.setattr(torch.Tensor, name, refuse)
            yield

    _static(True, monkeypatch)
    monkeypatch.setattr(graph_decode, "_no_host_reads", no_reads)
    processors = LogitsProcessorList([TopKLogitsWarper(top_k=20)])
    for sample in (False, True):
        _decode(tiny_model, sample=sample, bf16=True, processors=processors, capture=True)
        _decode(tiny_model, sample=sample, bf16=False, processors=processors)


def test_another_batch_moves_the_kept_cache_out_and_a_longer_one_grows_the_allocation(tiny_llama, monkeypatch):
    """A cache kept between turns lives in the static buffers; another batch decoding meanwhile moves it out
    first, so its next turn still continues it; a context past the allocation allocates a larger one."""
    model = tiny_llama.eval().requires_grad_(False)
    use_gqa_attention(model)
    _static(True, monkeypatch)

    def turn(cache, ids, mask):
        with bf16_inference(model, "cpu", True):
            result = decode_batch(model, ids, mask, cache, [6] * len(ids), eos_ids=set(), pad_id=0,
                                  processors=LogitsProcessorList(), do_sample=False, log_prob_temperature=1.0)
        return result.tokens, result.log_probs, result.ids, result.mask

    def two_turns(interleave: bool):
        cache = GrowingKVCache()
        ids = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(2))
        first = turn(cache, ids, torch.ones_like(ids))
        if interleave:  # another batch, longer than the allocation, decodes between the two turns
            other = torch.randint(3, 64, (2, 300), generator=torch.Generator().manual_seed(3))
            turn(GrowingKVCache(), other, torch.ones_like(other))
        extra = torch.randint(3, 64, (3, 2), generator=torch.Generator().manual_seed(4))
        return first[:2], turn(cache, torch.cat([first[2], extra], 1), torch.cat([first[3], torch.ones_like(extra)], 1))[:2]

    graph_decode._DECODERS.pop(model, None)
    alone = two_turns(False)
    before = static_decode_stats()
    interleaved = two_turns(True)
    after = static_decode_stats()
    assert interleaved == alone
    assert after["evictions"] - before["evictions"] >= 1 and after["allocations"] - before["allocations"] == 1
    decoder = next(iter(graph_decode._DECODERS[model].values()))
    assert decoder.cache.length == static_cache.allocation_length(300 + 6 - 1) == 512


def test_where_the_static_step_does_not_apply_the_host_loop_decodes(tiny_model, monkeypatch):
    ids = torch.randint(3, 64, (2, 5))
    cache = GrowingKVCache()
    with bf16_inference(tiny_model, "cpu", True):
        tiny_model(input_ids=ids, past_key_values=cache, use_cache=True)
        plain = LogitsProcessorList()
        assert static_decoder(tiny_model, cache, plain) is None  # auto: on CUDA only
        _static(True, monkeypatch)
        assert static_decoder(tiny_model, cache, plain) is not None
        assert static_decoder(tiny_model, cache, LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)])) is None
        assert static_decoder(tiny_model, GrowingKVCache(), plain) is None  # nothing prefilled
        handle = tiny_model.model.layers[0].register_forward_hook(lambda *args: None)
        assert static_decoder(tiny_model, cache, plain) is None  # a hook of someone else's would miss the steps
        handle.remove()
        with torch.enable_grad():
            assert static_decoder(tiny_model, cache, plain) is None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert static_decoder(tiny_model, cache, plain) is None
    monkeypatch.setattr(static_cache, "STATIC_DECODE", "sometimes")
    with pytest.raises(ValueError, match="auto, on or off"):
        static_cache.static_decode_selected("cpu")


def test_the_decoding_path_names_the_static_step(monkeypatch):
    assert decoding_path("cuda", True)["decode.step"] == "graph"  # auto: CUDA decodes in graphs
    monkeypatch.setattr(static_cache, "CUDA_GRAPHS", False)
    assert decoding_path("cuda", True)["decode.step"] == "static"
    assert decoding_path("cuda", True, bf16_weights=True)["decode.step"] == "static"
    _static(False, monkeypatch)
    assert decoding_path("cuda", True)["decode.step"] == "transformers"
    _static(True, monkeypatch)
    assert decoding_path("cpu", True)["decode.step"] == "static"
