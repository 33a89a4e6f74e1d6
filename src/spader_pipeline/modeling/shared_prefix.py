"""Decoder forward passes that encode the leading tokens every row shares only once.

Every sequence of a training batch starts with the same prompt-template instruction (~140 of
SmolLM2's ~370-450 tokens per warm-start demonstration or RL trajectory). A causal decoder's states
on those positions are identical across rows, so they are computed for one row and the other rows
attend to its keys and values. The result equals the plain batched forward up to floating-point
reassociation, gradients included: the shared keys and values are repeated with
``repeat_interleave``, whose backward sums the rows' gradients into the one prefix computation.
Used by the warm start's loss and the native trainer's log-probabilities (docs/training.md).
"""

from __future__ import annotations

import torch

MIN_SHARED_PREFIX = 8  # fewer common tokens than this are not worth a separate pass


def use_shared_prefix(setting: bool | str, device: torch.device) -> bool:
    """Whether training forwards on ``device`` encode the common prefix once (``setting``: ``true``,
    ``false`` or ``"auto"``).

    ``auto`` = on a CPU only. There a forward costs its arithmetic, and the prefix (~140 of a row's
    ~400-900 tokens) is saved work. On a GPU a forward of a small model costs its kernels, each
    launched by the host: the prefix pass and the continued pass run every block twice, about twice
    the launches of one plain pass (forward and backward, counted in docs/performance.md), to save
    arithmetic the device does in less time than the launches take.
    """
    if setting not in (True, False, "auto"):
        raise ValueError(f"shared_prefix is true, false or 'auto' (got {setting!r})")
    return device.type == "cpu" if setting == "auto" else bool(setting)


def common_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, minimum: int = MIN_SHARED_PREFIX) -> int:
    """Number of leading positions where every row has the same real token (``[B, T]`` inputs).

    At most ``T - 1`` (the rest of the forward needs one position); 0 for a single row or when
    the common part is shorter than ``minimum``.
    """
    if input_ids.shape[0] < 2 or input_ids.shape[1] < 2:
        return 0
    same = ((input_ids == input_ids[:1]) & (attention_mask == 1)).all(dim=0)  # [T]
    length = int(same[: input_ids.shape[1] - 1].long().cumprod(dim=0).sum())
    return length if length >= minimum else 0


def decoder_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                   min_shared_prefix: int = MIN_SHARED_PREFIX, shared_prefix: bool = True) -> torch.Tensor:
    """Last hidden states ``[B, T, H]`` of ``model``'s decoder body (no output layer).

    Rows are right-padded sequences starting at position 0 (``input_ids``, ``attention_mask``:
    ``[B, T]``). With ``shared_prefix``, a common prefix of ``P >= min_shared_prefix`` tokens is
    encoded once (``[1, P]``) and the rows continue from its key/value cache; otherwise this is one
    ordinary forward (:func:`use_shared_prefix` says which a device takes).
    """
    body = model.base_model
    prefix = common_prefix_length(input_ids, attention_mask, minimum=min_shared_prefix) if shared_prefix else 0
    if prefix == 0:  # one ordinary forward; no cache (its writes would be copies, and their backward)
        return body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    rows, width = input_ids.shape
    shared = body(input_ids=input_ids[:1, :prefix], use_cache=True)
    cache = shared.past_key_values
    cache.batch_repeat_interleave(rows)
    positions = torch.arange(prefix, width, device=input_ids.device).expand(rows, -1)
    rest = body(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, position_ids=positions,
                past_key_values=cache, use_cache=True).last_hidden_state  # [B, T - P, H]
    return torch.cat([shared.last_hidden_state.expand(rows, -1, -1), rest], dim=1)
