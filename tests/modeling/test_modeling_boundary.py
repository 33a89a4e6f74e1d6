"""Boundary states: the cache's states buffer follows every cache operation, and the top blocks run
from boundary states give the full forward's hidden states and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from spader_pipeline.modeling import TinyQwen3Spec, build_tiny_qwen3, train_top_layers
from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.boundary import (
    TopBlocksCache,
    bottom_block_states,
    capture_block_output,
    shares_frozen_blocks,
    supports_boundary,
    top_block_states,
)
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.shared_prefix import decoder_states


class _Vocab:
    eos_token_id, pad_token_id = 2, 0

    def __len__(self) -> int:
        return 300


@pytest.fixture(scope="module")
def deep_model():
    """A 4-block Qwen3 with grouped-query attention (the CPU ``sdpa_gqa`` path, as SmolLM2)."""
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=256)
    model = build_tiny_qwen3(_Vocab(), spec, seed=0)
    use_gqa_attention(model)
    return model


@pytest.fixture(scope="module")
def deep_llama():
    """A 4-block Llama with grouped-query attention: SmolLM2's architecture, scaled down."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    use_gqa_attention(model)
    return model


class _Reference:
    """The states buffer's expected contents, kept with plain tensor operations: ``rows[b]`` is row
    ``b``'s list of per-position states ``[H]``; ``active`` rows are the ones a write reaches."""

    def __init__(self) -> None:
        self.rows: list[list[torch.Tensor]] = []
        self.active: int | None = None

    def append(self, states: torch.Tensor) -> None:  # [b, T, H]
        if not self.rows:
            self.rows = [[] for _ in range(states.shape[0])]
        length = len(self.rows[0])
        for b, row in enumerate(self.rows):
            row.extend(states[b].unbind(0) if b < (self.active or len(self.rows)) else
                       [torch.zeros(states.shape[-1])] * states.shape[1])
        assert all(len(r) == length + states.shape[1] for r in self.rows)

    def tensor(self) -> torch.Tensor:
        return torch.stack([torch.stack(r) for r in self.rows]) if self.rows and self.rows[0] else torch.zeros(0)


def test_states_buffer_follows_every_cache_operation():
    """Appends (with reallocation), active rows, swaps, gathers, row selection with repeats,
    repetition, cropping, reordering and reset, against a plain reference and against the keys of a
    cache layer written with the same data."""
    torch.manual_seed(0)
    cache, ref = GrowingKVCache(capture_states=True), _Reference()

    def write(states: torch.Tensor) -> None:  # states [b, T, H]; the layer's keys hold the same numbers
        cache.update(states[:, None], -states[:, None], 0)
        cache.states.append(states)
        ref.append(states)

    def check() -> None:
        got = cache.states.states
        assert torch.equal(got, ref.tensor()) and cache.states.get_seq_length() == cache.get_seq_length()
        assert torch.equal(got, cache.layers[0].keys[:, 0])

    write(torch.randn(4, 5, 3))
    check()
    cache.swap_rows(1, 3)
    ref.rows[1], ref.rows[3] = ref.rows[3], ref.rows[1]
    check()
    cache.set_active_rows(2)
    ref.active = 2
    write(torch.randn(2, 1, 3))
    write(torch.randn(2, 70, 3))  # past the spare room: a reallocation
    cache.set_active_rows(None)
    ref.active = None
    check()
    index = torch.tensor([[0, 3, 5, 75], [1, 2, 4, 70], [0, 1, 2, 3], [4, 5, 74, 75]])
    cache.gather_positions(index)
    ref.rows = [[row[i] for i in index[b].tolist()] for b, row in enumerate(ref.rows)]
    check()
    cache.batch_select_indices(torch.tensor([2, 0, 0]))  # repeats: a shared prefix copied to rows
    ref.rows = [list(ref.rows[i]) for i in (2, 0, 0)]
    check()
    cache.batch_repeat_interleave(2)
    ref.rows = [list(r) for r in ref.rows for _ in range(2)]
    write(torch.randn(6, 2, 3))
    check()
    cache.crop(3)
    ref.rows = [r[:3] for r in ref.rows]
    check()
    cache.reorder_cache(torch.tensor([5, 4, 3, 2, 1, 0]))
    ref.rows = ref.rows[::-1]
    check()
    cache.reset()
    assert cache.states.get_seq_length() == 0 == cache.get_seq_length()
    assert torch.count_nonzero(cache.states._key_buffer) == 0
    assert GrowingKVCache().states is None  # capture is opt-in


def test_capture_hook_records_the_block_output_only_for_capturing_caches(deep_model):
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        full = deep_model(input_ids=ids, output_hidden_states=True).hidden_states[2]  # output of block 1
        with capture_block_output(deep_model, 1):
            cache = GrowingKVCache(capture_states=True)
            deep_model(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)
            deep_model(input_ids=ids[:, 6:], past_key_values=cache, use_cache=True)
            plain = GrowingKVCache()
            deep_model(input_ids=ids, past_key_values=plain, use_cache=True)
        deep_model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)  # hook removed
    assert plain.states is None and cache.states.get_seq_length() == 9
    assert torch.allclose(cache.states.states, full, atol=1e-5)


def _rows(prefix_len: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows: a common prefix, then rows of different lengths."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 300, (prefix_len,), generator=gen)
    lengths = [9, 4, 13]
    ids = torch.zeros((len(lengths), prefix_len + max(lengths)), dtype=torch.long)
    att = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, : prefix_len + n] = torch.cat([prefix, torch.randint(5, 300, (n,), generator=gen)])
        att[row, : prefix_len + n] = 1
    return ids, att


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("shared_prefix", [True, False])  # the prefix encoded once, or one pass
def test_top_blocks_from_boundary_equal_the_full_forward_states_and_gradients(deep_model, deep_llama, family,
                                                                              shared_prefix):
    model = copy.deepcopy(deep_model if family == "qwen3" else deep_llama).train()
    train_top_layers(model, 2)
    first = 2
    ids, att = _rows(12)
    with torch.no_grad():
        boundary = model.base_model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states[first]
    boundary = boundary * att.unsqueeze(-1)  # padding positions hold zeros, as in a batch
    weights = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def run(fn):
        model.zero_grad(set_to_none=True)
        hidden = fn()
        ((hidden * weights) * att.unsqueeze(-1)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return hidden.detach() * att.unsqueeze(-1), grads

    plain, plain_grads = run(lambda: decoder_states(model, ids, att, shared_prefix=shared_prefix))
    top, top_grads = run(lambda: top_block_states(model, boundary, ids, att, first_block=first,
                                                  shared_prefix=shared_prefix))
    assert torch.allclose(top, plain, atol=1e-5)
    assert plain_grads.keys() == top_grads.keys() and plain_grads
    assert all(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.")) for n in top_grads)
    for name, grad in plain_grads.items():
        error = float((top_grads[name] - grad).abs().max())
        assert error <= 1e-5 * float(grad.abs().max()) + 1e-7, (name, error)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bottom_blocks_give_the_full_forward_s_boundary_states(deep_model, deep_llama, family):
    """The embeddings and the frozen blocks alone: the full forward's states at every real position, and
    the top blocks from them its last hidden states."""
    model = deep_model if family == "qwen3" else deep_llama
    ids, att = _rows(12)
    real = att.unsqueeze(-1)
    with torch.no_grad():
        full = model.base_model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
        for first in (1, 3):
            boundary = bottom_block_states(model, ids, att, first_block=first)
            assert boundary.shape == full[first].shape and torch.isfinite(boundary).all()
            assert torch.allclose(boundary * real, full[first] * real, atol=1e-6)
            top = top_block_states(model, boundary, ids, att, first_block=first)
            assert torch.allclose(top * real, full[-1] * real, atol=1e-5)


def test_positions_after_a_row_s_covered_prefix_do_not_change_earlier_states(deep_model):
    """A capture covers a row's tokens but the last: zeros there change no earlier position."""
    ids, att = _rows(12)
    with torch.no_grad():
        boundary = deep_model.base_model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states[1]
        full = top_block_states(deep_model, boundary, ids, att, first_block=1)
        cut = boundary.clone()
        ends = att.sum(1) - 1
        for row, end in enumerate(ends.tolist()):
            cut[row, end:] = 0
        tail = top_block_states(deep_model, cut, ids, att, first_block=1)
    for row, end in enumerate(ends.tolist()):
        assert torch.allclose(tail[row, :end], full[row, :end], atol=1e-6)
        assert torch.isfinite(tail[row]).all()


def test_top_blocks_cache_lengths_come_from_the_first_run_block(deep_model):
    cache = TopBlocksCache(deep_model.config, first_block=2)
    assert cache.get_seq_length() == 0
    keys = torch.randn(1, 2, 5, 8)
    cache.update(keys, keys, 2)
    assert cache.get_seq_length() == 5 == cache.get_seq_length(2) and cache.get_mask_sizes(3, 0) == (8, 0)


def test_frozen_block_sharing_and_support(deep_model):
    other = copy.deepcopy(deep_model)
    assert shares_frozen_blocks(deep_model, other, 2)
    with torch.no_grad():
        other.model.layers[3].mlp.up_proj.weight.add_(1.0)  # a trained block: still shared
    assert shares_frozen_blocks(deep_model, other, 2)
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight.add_(1.0)  # a frozen block: not shared
    assert not shares_frozen_blocks(deep_model, other, 2)
    assert supports_boundary(deep_model, 2) and not supports_boundary(deep_model, 0)
    assert not supports_boundary(deep_model, 4) and not supports_boundary(torch.nn.Linear(2, 2), 1)
