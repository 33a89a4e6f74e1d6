"""Boundary states: the hidden states entering the first trained decoder block, computed once.

With the bottom blocks frozen (``trainable_layers``), their output on a token is the same in the
rollout that sampled it and in the update that trains on it; the update need not run them again.
The *boundary states* ``[B, T, H]`` are the output of the last frozen block (block ``first - 1``),
i.e. the input of the first trained block ``first``.

* **Capture** (:func:`capture_block_output`): while active, a forward hook on block ``first - 1``
  appends that block's output to the ``states`` buffer of the
  :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache` the block was called with, in the same
  calls and at the same positions as the cache's keys and values
  (:class:`~spader_pipeline.modeling.kv_cache.GrowingStates`).
* **Computed** (:func:`bottom_block_states`): the embeddings and the frozen blocks alone, where no
  rollout captured them (the warm start's demonstrations, :mod:`spader_pipeline.modeling.warm_start`).
* **Update** (:func:`top_block_states`): blocks ``first..N-1`` and the final norm run from the
  boundary states, with :func:`~spader_pipeline.modeling.shared_prefix.decoder_states`'s semantics
  (right-padded rows, the common prefix encoded once), calling transformers' mask functions, rotary
  embedding and decoder layers as ``LlamaModel.forward`` does. Equal to the full forward up to
  floating-point reassociation, gradients of the trained blocks included
  (``tests/modeling/test_modeling_boundary.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from spader_pipeline.modeling.decode_step import CAPTURED_BLOCK
from spader_pipeline.modeling.shared_prefix import MIN_SHARED_PREFIX, common_prefix_length

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TopBlocksCache",
    "bottom_block_states",
    "capture_block_output",
    "decoder_blocks",
    "first_trained_block",
    "shares_frozen_blocks",
    "supports_boundary",
    "top_block_states",
]

#: decoder families whose body is embeddings → blocks(hidden, mask, position embeddings, cache) →
#: norm, with one rotary embedding and full or sliding-window attention (``LlamaModel.forward``)
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention"})


def decoder_blocks(model: Any) -> torch.nn.ModuleList | None:
    """The decoder blocks of a causal LM (``model.model.layers``), or ``None``."""
    return getattr(getattr(model, "model", None), "layers", None)


def first_trained_block(model: Any, trainable_layers: int | None) -> int | None:
    """The first of the top ``trainable_layers`` decoder blocks, below which the blocks stay frozen;
    ``None`` when nothing is frozen (``trainable_layers`` unset or at least the model's depth)."""
    depth = len(decoder_blocks(model) or ())
    if trainable_layers is None or trainable_layers >= depth:
        return None
    return depth - trainable_layers


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * config.num_hidden_layers


def supports_boundary(model: Any, first_block: int) -> bool:
    """Whether boundary states can stand in for blocks ``0..first_block-1`` of ``model``: a supported
    family (:data:`SUPPORTED_MODEL_TYPES`) with blocks, final norm and rotary embedding, and
    ``0 < first_block < number of blocks``."""
    blocks = decoder_blocks(model)
    config = getattr(model, "config", None)
    if blocks is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    body = model.model
    if not (hasattr(body, "norm") and hasattr(body, "rotary_emb")) or not 0 < first_block < len(blocks):
        return False
    return set(_layer_types(config)) <= _ATTENTION_KINDS


@contextmanager
def capture_block_output(model: Any, block: int) -> Iterator[None]:
    """While active, decoder block ``block``'s output ``[b, T, H]`` is appended (detached) to the
    ``states`` buffer of the cache it is called with (``past_key_values``, a
    :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache` with ``capture_states=True``);
    calls without such a cache record nothing. Decoding steps that bypass the modules
    (:class:`~spader_pipeline.modeling.decode_step.FusedDecodeStep`) append the same output."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        states = getattr(kwargs.get("past_key_values"), "states", None)
        if states is not None:
            states.append((output[0] if isinstance(output, tuple) else output).detach())

    handle = decoder_blocks(model)[block].register_forward_hook(hook, with_kwargs=True)
    CAPTURED_BLOCK[model] = (block, handle.id)  # the fused decoding step appends as the hook would
    try:
        yield
    finally:
        handle.remove()
        CAPTURED_BLOCK.pop(model, None)


class TopBlocksCache(DynamicCache):
    """A ``DynamicCache`` for a run of blocks ``first_block..N-1`` only.

    transformers reads the cache's length and mask sizes from layer 0 (or the first layer of the
    mask's kind), which this run never fills; here they come from the first run block of that kind.
    """

    def __init__(self, config: Any, first_block: int) -> None:
        super().__init__(config=config)
        self.first_block = first_block

    def _source(self, layer_idx: int) -> int:
        if layer_idx >= self.first_block:
            return layer_idx
        sliding = self.is_sliding
        same = [i for i in range(self.first_block, len(sliding)) if sliding[i] == sliding[layer_idx]]
        return same[0] if same else self.first_block

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._source(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._source(layer_idx))


def _run_blocks(body: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                blocks: range, cache: TopBlocksCache | None) -> torch.Tensor:
    """Decoder blocks ``blocks`` on ``hidden`` ``[b, t, H]`` (positions ``position_ids`` ``[b or 1, t]``;
    ``attention_mask`` ``[b, cached + t]`` or ``None``), called as ``LlamaModel.forward`` calls them,
    continuing ``cache`` (``None``: no cache, nothing cached before). Returns ``[b, t, H]``."""
    config = body.config
    types = _layer_types(config)
    mask_kwargs = {"config": config, "inputs_embeds": hidden, "attention_mask": attention_mask,
                   "past_key_values": cache, "position_ids": position_ids}
    masks = {"full_attention": create_causal_mask(**mask_kwargs)}
    if "sliding_attention" in (types[i] for i in blocks):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
    position_embeddings = body.rotary_emb(hidden, position_ids)
    for index in blocks:
        hidden = body.layers[index](
            hidden, attention_mask=masks[types[index]], position_embeddings=position_embeddings,
            position_ids=position_ids, past_key_values=cache, use_cache=cache is not None,
        )
    return hidden


def _run_top_blocks(body: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor, first_block: int, cache: TopBlocksCache | None) -> torch.Tensor:
    """Blocks ``first_block..N-1`` and the final norm (:func:`_run_blocks`). Returns ``[b, t, H]``."""
    blocks = range(first_block, body.config.num_hidden_layers)
    return body.norm(_run_blocks(body, hidden, attention_mask, position_ids, blocks, cache))


def bottom_block_states(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                        first_block: int) -> torch.Tensor:
    """The boundary states ``[B, T, H]`` of right-padded rows (``input_ids``, ``attention_mask``:
    ``[B, T]``, starting at position 0): the embeddings and blocks ``0..first_block-1``, no cache, as
    the full forward computes them. What a padding position holds is unspecified (finite)."""
    body = model.base_model
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    hidden = body.embed_tokens(input_ids)
    return _run_blocks(body, hidden, attention_mask, positions, range(first_block), None)


def top_block_states(model: Any, boundary: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                     first_block: int, min_shared_prefix: int = MIN_SHARED_PREFIX,
                     shared_prefix: bool = True) -> torch.Tensor:
    """Last hidden states ``[B, T, H]`` (after the final norm) from the boundary states.

    Args:
        model: a causal LM (:func:`supports_boundary`).
        boundary: float ``[B, T, H]``, the output of block ``first_block - 1`` at every position
            (positions a row's loss never reads from may hold anything finite, e.g. zeros).
        input_ids: long ``[B, T]``, right-padded rows starting at position 0 (only compared, to find
            the prefix every row shares).
        attention_mask: ``[B, T]``, 1 on real tokens.
        first_block: the first block to run.

    As :func:`~spader_pipeline.modeling.shared_prefix.decoder_states`: with ``shared_prefix``, a common
    prefix of ``P >= min_shared_prefix`` tokens is run once (row 0's boundary states, ``[1, P]``) and
    the rows continue from its key/value cache; otherwise one pass over the whole batch.
    """
    body = model.base_model
    rows, width = input_ids.shape
    device = boundary.device
    prefix = common_prefix_length(input_ids, attention_mask, minimum=min_shared_prefix) if shared_prefix else 0
    if prefix == 0:  # one pass, nothing to continue: no cache (its writes would be copies, and their backward)
        positions = torch.arange(width, device=device)[None]
        return _run_top_blocks(body, boundary, attention_mask, positions, first_block, None)
    cache = TopBlocksCache(body.config, first_block)
    shared = _run_top_blocks(body, boundary[:1, :prefix], None, torch.arange(prefix, device=device)[None],
                             first_block, cache)
    cache.batch_repeat_interleave(rows)
    positions = torch.arange(prefix, width, device=device).expand(rows, -1)
    rest = _run_top_blocks(body, boundary[:, prefix:], attention_mask, positions, first_block, cache)  # [B, T - P, H]
    return torch.cat([shared.expand(rows, -1, -1), rest], dim=1)


@torch.no_grad()
def shares_frozen_blocks(model: Any, other: Any, first_block: int) -> bool:
    """Whether ``other`` computes the same boundary states as ``model``: equal embeddings and blocks
    ``0..first_block-1`` (e.g. a reference model copied from the policy before training)."""
    if other is model:
        return True
    ours, theirs = decoder_blocks(model), decoder_blocks(other)
    if ours is None or theirs is None or len(ours) != len(theirs) or not 0 < first_block <= len(ours):
        return False
    modules = [(model.get_input_embeddings(), other.get_input_embeddings())]
    modules += [(ours[i], theirs[i]) for i in range(first_block)]
    for mine, yours in modules:
        a, b = mine.state_dict(), yours.state_dict()
        if a.keys() != b.keys() or not all(a[k].shape == b[k].shape and torch.equal(a[k], b[k].to(a[k].device))
                                           for k in a):
            return False
    return True
