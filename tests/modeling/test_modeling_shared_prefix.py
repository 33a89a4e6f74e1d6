"""Encoding the instruction every row shares once gives the plain forward's states and gradients."""

from __future__ import annotations

import pytest
import torch

from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.modeling.shared_prefix import common_prefix_length, decoder_states, use_shared_prefix


def _batch(prefix_len: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows: a common prefix, then rows of different lengths."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(5, 300, (prefix_len,), generator=gen)
    lengths = [9, 4, 13]
    width = prefix_len + max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    att = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, : prefix_len + n] = torch.cat([prefix, torch.randint(5, 300, (n,), generator=gen)])
        att[row, : prefix_len + n] = 1
    return ids, att


def test_common_prefix_length():
    ids, att = _batch(12)
    assert common_prefix_length(ids, att) >= 12
    assert common_prefix_length(ids[:1], att[:1]) == 0  # one row shares with nobody
    assert common_prefix_length(ids, att, minimum=100) == 0
    same = ids[:1, :21].repeat(3, 1)  # identical unpadded rows: all but the last position
    assert common_prefix_length(same, torch.ones_like(same), minimum=1) == 20


@pytest.mark.parametrize("trainable", ["all", "top"])
def test_shared_prefix_states_and_gradients_equal_the_plain_forward(tiny_model_dir, trainable):
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model.train()
    if trainable == "top":  # frozen bottom layers, as the warm start and the native trainer train
        for p in model.base_model.layers[0].parameters():
            p.requires_grad_(False)
    ids, att = _batch(12)
    weights = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def run(fn):
        model.zero_grad(set_to_none=True)
        hidden = fn()
        ((hidden * weights) * att.unsqueeze(-1)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return hidden.detach() * att.unsqueeze(-1), grads

    plain, plain_grads = run(lambda: model.base_model(input_ids=ids, attention_mask=att).last_hidden_state)
    shared, shared_grads = run(lambda: decoder_states(model, ids, att))
    assert torch.allclose(shared, plain, atol=1e-5)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        error = float((shared_grads[name] - grad).abs().max())
        assert error <= 1e-5 * float(grad.abs().max()) + 1e-7, (name, error)  # float reassociation only


def test_without_the_shared_prefix_the_states_are_the_plain_forward_s(tiny_model_dir):
    """``shared_prefix=False`` (a GPU's default) is one ordinary forward: its states bit for bit."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    ids, att = _batch(12)
    with torch.no_grad():
        plain = model.base_model(input_ids=ids, attention_mask=att).last_hidden_state
        assert torch.equal(decoder_states(model, ids, att, shared_prefix=False), plain)


def test_the_shared_prefix_is_the_cpu_s_unless_set():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_shared_prefix("auto", cpu) and not use_shared_prefix("auto", cuda)
    assert use_shared_prefix(True, cuda) and not use_shared_prefix(False, cpu)
    with pytest.raises(ValueError, match="shared_prefix"):
        use_shared_prefix("yes", cpu)
