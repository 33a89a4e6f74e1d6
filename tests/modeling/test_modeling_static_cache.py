"""The static cache's sizes and bookkeeping (modeling/static_cache.py), a GrowingKVCache living in its
buffers (kv_cache.py: move_storage, own_storage), and the static step's attention as the switches choose
and ``decoding_path`` reports it."""

from __future__ import annotations

import pytest
import torch

from spader_pipeline.modeling import static_cache, triton_attention
from spader_pipeline.modeling.decode_step import decoding_path
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.static_cache import (
    LENGTH_QUANTUM,
    ROW_BUCKETS,
    StaticKVCache,
    allocation_length,
    length_bucket,
    row_bucket,
)


def test_rows_and_lengths_round_up_to_their_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 17, 65, 200, 768)] == [1, 2, 4, 8, 32, 96, 256, 768]
    assert row_bucket(ROW_BUCKETS[-1] + 1) == 2 * ROW_BUCKETS[-1]  # past the largest: its multiples
    assert [length_bucket(n, 4096) for n in (1, 256, 257, 700)] == [256, 256, 512, 768]
    assert length_bucket(700, 600) == 600  # never past the allocation
    sizes = [allocation_length(n) for n in (1, 300, 769, 1025, 1537, 2049, 3073, 4097)]
    assert sizes == [256, 512, 1024, 1536, 2048, 3072, 4096, 6144]
    assert all(size % LENGTH_QUANTUM == 0 for size in sizes)


def _cache(rows=4, length=16, steps=6, states=8):
    return StaticKVCache(layers=2, kv_heads=2, head_dim=4, rows=rows, length=length, steps=steps,
                         kv_dtype=torch.bfloat16, device=torch.device("cpu"), states_width=states)


def test_a_call_begins_with_its_rows_going_and_the_rest_ended():
    cache = _cache()
    cache.done.zero_()
    cache.valid.fill_(True)
    cache.first.fill_(9)
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    cache.begin(rows=2, width=3, mask=mask, positions=torch.tensor([3, 2]), budgets=[5, 2],
                uniforms=torch.full((5, 2), 0.5))
    assert cache.valid[:2, :3].long().tolist() == mask.tolist() and not cache.valid[:, 3:].any() and not cache.valid[2:].any()
    assert cache.first.tolist() == [0, 1, 0, 0]  # each row's first held position: its left padding ends there
    assert cache.done.tolist() == [False, False, True, True] and cache.budget.tolist() == [5, 2, 0, 0]
    assert cache.position.tolist() == [3, 2, 0, 0] and int(cache.cursor) == 3 and int(cache.step) == 0
    assert cache.fits(rows=4, length=16, steps=6, states_width=8) and not cache.fits(rows=5, length=16, steps=6,
                                                                                   states_width=None)
    assert not cache.fits(rows=4, length=16, steps=6, states_width=16)


def test_compaction_exchanges_rows_in_every_buffer_up_to_the_positions_written():
    cache = _cache()
    for number, buffer in enumerate([*cache.keys, *cache.values, cache.states]):
        buffer.copy_(torch.arange(buffer.numel()).reshape(buffer.shape) + number)
    for buffer in (cache.token, cache.position, cache.budget, cache.count, cache.first):
        buffer.copy_(torch.arange(4))
    cache.tokens.copy_(torch.arange(4)[:, None].expand(-1, cache.steps))
    cache.uniforms.copy_(torch.arange(4.0)[None].expand(cache.steps, -1))
    before = [buffer.clone() for buffer in [*cache.keys, *cache.values, cache.states]]
    cache.compact([0], [3], positions=5)
    for old, new in zip(before, [*cache.keys, *cache.values, cache.states], strict=True):
        assert torch.equal(new[0, :, :5], old[3, :, :5]) and torch.equal(new[3, :, :5], old[0, :, :5])
        assert torch.equal(new[:, :, 5:], old[:, :, 5:]) and torch.equal(new[1:3], old[1:3])  # the rest as it was
    assert cache.token.tolist() == cache.count.tolist() == cache.first.tolist() == [3, 1, 2, 0]
    assert cache.tokens[:, 0].tolist() == [3, 1, 2, 0] and cache.uniforms[0].tolist() == [3.0, 1.0, 2.0, 0.0]


def test_a_growing_cache_moves_into_static_buffers_once_and_out_again():
    """The prefill's cache moves into the static buffers (its filled positions copied), later turns find it
    there (nothing copied), its operations keep working in them, and it moves out into its own buffers."""
    cache = GrowingKVCache(capture_states=True)
    keys = torch.randn(3, 2, 5, 4).to(torch.bfloat16)
    for layer in range(2):
        cache.update(keys + layer, keys - layer, layer)
    cache.states.append(torch.randn(3, 5, 8))
    static = _cache(rows=4, length=16)
    views = ([k[:3] for k in static.keys], [v[:3] for v in static.values], static.states[:3])
    cache.move_storage(*views)
    assert all(layer.holds(k) for layer, k in zip(cache.layers, views[0], strict=True)) and cache.states.holds(views[2])
    assert torch.equal(cache.layers[1].keys, keys + 1) and torch.equal(static.keys[1][:3, :, :5], keys + 1)
    static.keys[0][:3, :, 5] = 7  # a captured step writes position 5 in place
    cache.reserve(1)
    assert (cache.layers[0].keys[:, :, 5] == 7).all()
    cache.batch_select_indices(torch.tensor([2, 0]))  # distinct rows: in place, still in the static buffers
    assert cache.layers[0]._key_buffer.data_ptr() == static.keys[0].data_ptr()
    assert torch.equal(cache.layers[0].keys[:, :, :5], keys[[2, 0]])
    cache.own_storage(static.pointers())
    assert cache.layers[0]._key_buffer.data_ptr() not in static.pointers()
    static.keys[0].zero_()
    assert torch.equal(cache.layers[0].keys[:, :, :5], keys[[2, 0]]) and cache.get_seq_length() == 6


#: per switch of the static step: (its module variable, the decoding path's key, its default, what bf16 weights
#: get when it chooses Triton, what the CPU's autocast reports)
SWITCHES = {
    "attention": ("DECODE_ATTENTION", "decode.attention", "sdpa", "triton", ("cpp", "sdpa")),
    "kernels": ("DECODE_KERNELS", "decode.kernels", "aten", "aten", ("cpp", "aten")),
}


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_the_static_steps_triton_switches_are_chosen_and_reported(monkeypatch, switch):
    """On CUDA the static step attends with SDPA or the Triton kernel (``SPADER_DECODE_ATTENTION``), and runs the
    work between its products as torch's operations or the fused Triton kernels (``SPADER_DECODE_KERNELS``;
    those take an fp32 residual stream: not bf16 weights), Triton where chosen and Triton runs, said so where
    it does not; the CPU's autocast keeps its own; another value is refused."""
    variable, key, default, bf16_weights, cpu = SWITCHES[switch]
    assert decoding_path("cuda", True)[key] == default
    monkeypatch.setattr(static_cache, variable, "triton")
    monkeypatch.setattr(triton_attention, "available", lambda: False)
    assert decoding_path("cuda", True)[key] == default  # no Triton here: torch's, and said so
    monkeypatch.setattr(triton_attention, "available", lambda: True)
    assert decoding_path("cuda", True)[key] == "triton"
    assert decoding_path("cuda", False)[key] == "triton"
    assert decoding_path("cuda", True, bf16_weights=True)[key] == bf16_weights
    assert decoding_path("cpu", False)[key] == default  # the static step is off on a CPU by default
    assert decoding_path("cpu", True)[key] in cpu
    monkeypatch.setattr(static_cache, variable, "flash")
    with pytest.raises(ValueError, match=f"SPADER_{variable}"):
        decoding_path("cuda", True)


@pytest.mark.parametrize("value", ["64,8", "48,4,3", "64,3,3", "64,4,0", "fast"])
def test_a_triton_launch_it_cannot_take_is_refused_with_the_form(monkeypatch, value):
    monkeypatch.setattr(triton_attention, "LAUNCH", value)
    with pytest.raises(ValueError, match="SPADER_TRITON_LAUNCH.*block,warps,stages"):
        triton_attention.launch()


def test_another_triton_launch_is_taken_and_recorded(monkeypatch):
    """``SPADER_TRITON_LAUNCH`` (what a lease's attention benchmark found the fastest) is the kernel's launch,
    and the run's decoding path names it; the default launch is plain ``triton``."""
    monkeypatch.setattr(static_cache, "DECODE_ATTENTION", "triton")
    monkeypatch.setattr(triton_attention, "available", lambda: True)
    assert triton_attention.launch() == triton_attention.DEFAULT_LAUNCH
    monkeypatch.setattr(triton_attention, "LAUNCH", "128, 8, 2")
    assert triton_attention.launch() == (128, 8, 2)
    assert decoding_path("cuda", True)["decode.attention"] == "triton 128/8/2"
    monkeypatch.setattr(triton_attention, "LAUNCH", "64,4,3")
    assert decoding_path("cuda", True)["decode.attention"] == "triton"
