"""GrowingKVCache: the same keys/values and generations as transformers' DynamicCache, written in place."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from spader_pipeline.modeling import decode_attention, kv_cache
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.decode_attention import bf16_decode_attention_available
from spader_pipeline.modeling.kv_cache import GrowingKVCache, GrowingLayer

#: both ways a cache rearranges its rows and positions (:data:`kv_cache.ROW_BY_ROW_DEVICES`): in place a row
#: at a time (the CPU's) and one indexed copy per buffer (a GPU's), each run here on the CPU
REARRANGEMENTS = {"row-by-row": frozenset({"cpu"}), "one-copy": frozenset()}


def test_layer_appends_in_place_and_matches_concatenation():
    layer, chunks = GrowingLayer(), [torch.randn(3, 2, n, 4) for n in (5, 1, 1, 70, 1)]
    pointers = []
    for i, chunk in enumerate(chunks):
        keys, values = layer.update(chunk, -chunk)
        expected = torch.cat(chunks[: i + 1], dim=-2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        assert layer.get_seq_length() == expected.shape[-2]
        pointers.append(keys.data_ptr())
    assert pointers[0] == pointers[1] == pointers[2] != pointers[3] == pointers[4]  # one reallocation
    layer.batch_select_indices(torch.tensor([2, 0, 0]))
    full = torch.cat(chunks, dim=-2)
    assert torch.equal(layer.keys, full[[2, 0, 0]]) and torch.equal(layer.values, -full[[2, 0, 0]])
    layer.crop(10)
    assert layer.get_seq_length() == 10 and torch.equal(layer.keys, full[[2, 0, 0], :, :10])
    layer.batch_repeat_interleave(2)
    rows = [2, 2, 0, 0, 0, 0]
    assert torch.equal(layer.keys, full[rows, :, :10]) and torch.equal(layer.values, -full[rows, :, :10])
    keys, _ = layer.update(chunks[4][:1].repeat(6, 1, 1, 1), -chunks[4][:1].repeat(6, 1, 1, 1))
    assert keys.shape[-2] == 11 and torch.equal(keys[:, :, 10:], chunks[4][:1].expand(6, -1, -1, -1))


def test_generation_and_continuation_equal_dynamic_cache(gqa_model_dir):
    """Left-padded batch: prefill, greedy decoding, then a continuation with more tokens on a subset
    of rows, as HFGenerator does between turns; logits and tokens equal the DynamicCache's."""
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    ids = torch.randint(3, 64, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    extra = torch.randint(3, 64, (2, 5))  # the next turn's new tokens (an observation)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    runs = {}
    for name, make in (("dynamic", DynamicCache), ("growing", GrowingKVCache)):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=make(), **kwargs)
            cache = out.past_key_values
            assert isinstance(cache, make)
            cache.batch_select_indices(torch.tensor([0, 2]))
            seq = torch.cat([out.sequences[[0, 2]], extra], dim=1)
            att = torch.cat([mask[[0, 2]], torch.ones(2, seq.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
            more = model.generate(input_ids=seq, attention_mask=att, past_key_values=cache, **kwargs)
        runs[name] = (out.sequences, torch.stack(out.logits), more.sequences, torch.stack(more.logits))
    dynamic, growing = runs["dynamic"], runs["growing"]
    assert torch.equal(dynamic[0], growing[0]) and torch.equal(dynamic[2], growing[2])
    assert torch.allclose(dynamic[1], growing[1], atol=1e-5) and torch.allclose(dynamic[3], growing[3], atol=1e-5)


def test_active_rows_and_swaps_leave_the_other_rows_alone():
    """Only the first ``rows`` rows are exposed and written; swapped rows carry their whole cache;
    positions a row never wrote are zeros, through a reallocation too."""
    cache, first = GrowingKVCache(), torch.randn(4, 2, 3, 4)
    cache.update(first, -first, 0)
    layer = cache.layers[0]
    cache.swap_rows(1, 3)
    cache.set_active_rows(2)
    step = torch.randn(2, 2, 70, 4)  # past the spare room: a reallocation
    keys, values = cache.update(step, -step, 0)
    assert keys.shape == (2, 2, 73, 4) and torch.equal(keys[:, :, 3:], step) and torch.equal(values, -keys)
    cache.set_active_rows(None)
    assert layer.keys.shape == (4, 2, 73, 4)
    assert torch.equal(layer.keys[:, :, :3], first[[0, 3, 2, 1]])
    assert torch.equal(layer.keys[2:, :, 3:], torch.zeros(2, 2, 70, 4))
    assert torch.count_nonzero(layer._key_buffer[:, :, 73:]) == 0


def test_move_rows_equals_the_swaps_it_stands_for():
    """Moving several rows at once (one permutation) leaves every layer, the captured states too, as
    the same exchanges made one by one."""
    first = torch.randn(6, 2, 5, 4)
    one_by_one, at_once = GrowingKVCache(capture_states=True), GrowingKVCache(capture_states=True)
    for cache in (one_by_one, at_once):
        cache.update(first, -first, 0)
        cache.update(2 * first, first, 1)
        cache.states.append(first[:, 0])
    one_by_one.swap_rows(0, 5)
    one_by_one.swap_rows(2, 4)
    at_once.move_rows(torch.tensor([0, 2, 5, 4]), torch.tensor([5, 4, 0, 2]))
    for a, b in zip([*one_by_one.layers, one_by_one.states], [*at_once.layers, at_once.states], strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(at_once.layers[1].keys[:, :, :5], 2 * first[[5, 1, 4, 3, 2, 0]])


@pytest.mark.parametrize("devices", REARRANGEMENTS.values(), ids=REARRANGEMENTS)
def test_gather_positions_keeps_each_rows_positions(devices, monkeypatch):
    monkeypatch.setattr(kv_cache, "ROW_BY_ROW_DEVICES", devices)
    cache, keys = GrowingKVCache(capture_states=True), torch.randn(2, 2, 6, 4)
    cache.update(keys, -keys, 0)
    cache.states.append(keys[:, 1])
    layer = cache.layers[0]
    pointer = layer._key_buffer.data_ptr()
    index = torch.tensor([[0, 2, 5], [1, 3, 4]])
    cache.gather_positions(index)
    expected = torch.stack([keys[0][:, [0, 2, 5]], keys[1][:, [1, 3, 4]]])
    assert cache.get_seq_length() == 3 and torch.equal(layer.keys, expected) and torch.equal(layer.values, -expected)
    assert torch.equal(cache.states.states, expected[:, 1])  # the states follow their positions
    assert torch.count_nonzero(layer._key_buffer[:, :, 3:]) == 0 and layer._key_buffer.data_ptr() == pointer


def test_row_windows_append_each_block_after_the_same_length():
    """Blocks of rows written after the same cached length, the first one reallocating: every row
    keeps what it had, each block's positions land after it, the rest of a shorter block is zeros,
    and closing the windows exposes every row as long as the furthest write."""
    cache, first = GrowingKVCache(), torch.randn(5, 2, 3, 4)
    cache.update(first, -first, 0)
    layer = cache.layers[0]
    wide, narrow = torch.randn(2, 2, 70, 4), torch.randn(3, 2, 5, 4)  # 70: past the spare room
    cache.row_window(0, 2, 3)
    keys, _ = cache.update(wide, -wide, 0)
    assert keys.shape == (2, 2, 73, 4) and cache.get_seq_length() == 73
    cache.row_window(2, 5, 3)
    assert cache.get_seq_length() == 3 and torch.equal(layer.keys, first[2:])
    keys, values = cache.update(narrow, -narrow, 0)
    assert keys.shape == (3, 2, 8, 4) and torch.equal(keys[:, :, 3:], narrow) and torch.equal(values, -keys)
    cache.close_windows()
    assert cache.get_seq_length() == 73 and layer.keys.shape == (5, 2, 73, 4)
    assert torch.equal(layer.keys[:, :, :3], first)
    assert torch.equal(layer.keys[:2, :, 3:], wide)
    assert torch.equal(layer.keys[2:, :, 3:8], narrow) and torch.count_nonzero(layer.keys[2:, :, 8:]) == 0


@pytest.mark.parametrize("devices", REARRANGEMENTS.values(), ids=REARRANGEMENTS)
@pytest.mark.parametrize("rows", [[3, 0, 4, 1, 2], [4, 2], [0, 1, 2, 3, 4], [1, 2, 0]])
def test_selecting_distinct_rows_moves_them_in_place(rows, devices, monkeypatch):
    """A reordering or a subset of distinct rows: the same contents as indexing, in the same buffer,
    the capacity's zeros kept; a row at a time and in one copy alike."""
    monkeypatch.setattr(kv_cache, "ROW_BY_ROW_DEVICES", devices)
    cache, keys = GrowingKVCache(capture_states=True), torch.randn(5, 2, 6, 4)
    cache.update(keys, -keys, 0)
    cache.states.append(keys[:, 0])
    layer = cache.layers[0]
    pointer = layer._key_buffer.data_ptr()
    cache.batch_select_indices(torch.tensor(rows))
    assert torch.equal(layer.keys, keys[rows]) and torch.equal(layer.values, -keys[rows])
    assert torch.equal(cache.states.states, keys[rows, 0])
    assert layer._key_buffer.data_ptr() == pointer and torch.count_nonzero(layer._key_buffer[:, :, 6:]) == 0


@pytest.mark.parametrize("bf16_cache", [True, False], ids=["bf16-cache", "fp32-cache"])
def test_fp32_keys_beside_bf16_values_share_one_dtype_in_the_cache(bf16_cache, monkeypatch):
    """Under bf16 autocast the keys come fp32 (rotary's fp32 cos/sin) and the values bf16. Off the CPU
    (the meta device stands in for CUDA here) both are cached in bf16, the dtype attention casts them
    to; on the CPU the keys are rounded to bf16 with a bf16 key cache (the default, whether the native
    attention builds or not), and both are cached in bf16 where the native attention reads them, else in
    fp32 (SDPA attends in fp32), holding exactly the (rounded) values given."""
    monkeypatch.setattr(decode_attention, "BF16_CACHE", bf16_cache)
    cpu_dtype = torch.bfloat16 if bf16_cache and bf16_decode_attention_available() else torch.float32
    for device, expected in (("meta", torch.bfloat16), ("cpu", cpu_dtype)):
        layer = GrowingLayer()
        keys = torch.randn(2, 3, 5, 4, device=device)
        values = torch.randn(2, 3, 6, 4, device=device, dtype=torch.bfloat16)
        layer.update(keys, values[:, :, :5])
        layer.update(keys[:, :, :1], values[:, :, 5:])
        assert layer.keys.dtype == expected and layer.values.dtype == expected
        assert layer.get_seq_length() == 6
        if device == "cpu":
            assert torch.equal(layer.keys[:, :, :5], (keys.to(torch.bfloat16) if bf16_cache else keys).to(cpu_dtype))
            assert torch.equal(layer.values, values.to(cpu_dtype))


def test_fp32_values_change_no_logit_under_cpu_autocast(gqa_model_dir, monkeypatch):
    """The fp32 value cache is a speed-up only: under CPU bf16 autocast, greedy decoding and a
    continued turn (a prefill over the cache, which autocast casts back to bf16) give the same
    tokens and logits whether the values are cached in fp32 or in bf16."""
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    ids = torch.randint(3, 64, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    extra = torch.randint(3, 64, (3, 5))
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    runs = {}
    monkeypatch.setattr(decode_attention, "BF16_CACHE", False)  # the fp32 key cache's layout
    for fp32_values in (True, False):
        monkeypatch.setattr(GrowingLayer, "fp32_values_on_cpu", fp32_values)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=GrowingKVCache(), **kwargs)
            assert out.past_key_values.layers[0].values.dtype == (torch.float32 if fp32_values else torch.bfloat16)
            seq = torch.cat([out.sequences, extra], dim=1)
            att = torch.cat([mask, torch.ones(3, seq.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
            more = model.generate(input_ids=seq, attention_mask=att, past_key_values=out.past_key_values, **kwargs)
        runs[fp32_values] = (out.sequences, torch.stack(out.logits), more.sequences, torch.stack(more.logits))
    for fp32_run, bf16_run in zip(runs[True], runs[False], strict=True):
        assert torch.equal(fp32_run, bf16_run)


@pytest.mark.gpu
def test_on_cuda_bf16_keys_change_no_logit_under_autocast(gqa_model_dir):  # pragma: no cover - needs a GPU
    """On CUDA, attention under autocast reads bf16 keys whatever the cache holds: the same logits as
    DynamicCache, which keeps them fp32."""
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval().to("cuda")
    ids = torch.randint(3, 64, (2, 9), device="cuda")
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    runs = {}
    for name, make in (("dynamic", DynamicCache), ("growing", GrowingKVCache)):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            runs[name] = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=make(),
                                        **kwargs)
    assert runs["growing"].past_key_values.layers[0].keys.dtype == torch.bfloat16
    assert torch.equal(runs["dynamic"].sequences, runs["growing"].sequences)
    assert torch.equal(torch.stack(runs["dynamic"].logits), torch.stack(runs["growing"].logits))


def test_off_the_cpu_a_rearrangement_dispatches_the_same_operations_for_any_number_of_rows(monkeypatch):
    """One copy a buffer (a GPU's way): reordering the rows and closing the gaps dispatch as many operations
    for 32 rows as for 4 (a row at a time, the CPU's way, dispatches a few per row: on a GPU each is a launch
    or the host's time before one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.operations = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operations += 1
            return func(*args, **(kwargs or {}))

    def operations(rows: int, devices: frozenset) -> int:
        monkeypatch.setattr(kv_cache, "ROW_BY_ROW_DEVICES", devices)
        cache = GrowingKVCache(capture_states=True)
        for layer in range(3):
            keys = torch.randn(rows, 2, 8, 4)
            cache.update(keys, -keys, layer)
        cache.states.append(torch.randn(rows, 8, 6))
        index = torch.arange(2, 8).expand(rows, 6)
        with Count() as count:
            cache.batch_select_indices(torch.arange(rows).flip(0))
            cache.gather_positions(index)
        return count.operations

    one_copy = REARRANGEMENTS["one-copy"]
    assert operations(4, one_copy) == operations(32, one_copy)
    assert operations(32, REARRANGEMENTS["row-by-row"]) > 4 * operations(32, one_copy)
