"""The decoder server's weights: what a trainer may leave out of an update, and a checksum the tests
compare updates (and the server's weights with the actor's) by."""

from __future__ import annotations

import torch


def tied_to_embeddings(model: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is the output layer tied to the input embeddings (a trainer may not send it)."""
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def weights_checksum(model: torch.nn.Module) -> float:
    """A position-weighted sum of every weight (one pass over memory): two weight updates that change
    any weight differ in it (tests compare updates, and the server's weights with the actor's, by it)."""
    with torch.no_grad():
        return float(sum((k + 1) * tensor.double().sum() for k, (_, tensor) in
                         enumerate(sorted(model.state_dict().items()))))
