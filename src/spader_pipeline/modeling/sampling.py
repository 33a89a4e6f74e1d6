"""Drawing a token from a row's distribution, and the log-probability of the token drawn.

Both decoding loops use them (:func:`~spader_pipeline.modeling.decode.decode_batch`'s step by step on the
host, and :mod:`~spader_pipeline.modeling.graph_decode`'s on the device, inside a captured step): the same
draws from the same uniform numbers, and the same log-probabilities.
"""

from __future__ import annotations

import torch

__all__ = ["sample_categorical", "token_log_probs"]


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor | None = None, *,
                       host_check: bool = True) -> torch.Tensor:
    """One draw per row from the categorical distributions ``probs`` ``[n, V]`` (rows sum to ~1).

    Inverse-CDF sampling: one uniform number per row against the row's cumulative sum. The same
    distribution as ``torch.multinomial(probs, 1)``, which on CPU draws an exponential variate for
    every vocabulary entry (49k per row for SmolLM2, ~9% of a rollout's time). A token of
    probability 0 (cut by top-p/top-k) is never drawn: the first index whose cumulative sum exceeds
    the draw is always one where the sum grew. ``uniforms`` ``[n]``: the uniform numbers in [0, 1) to
    draw with; ``None``: from the global torch RNG (seeded runs repeat). Returns long ``[n]``.

    ``host_check``: look on the host whether a draw rounded up to its row's total before mending it (a
    rare event; the check saves the mending's reduction over the vocabulary at every step on a CPU).
    ``False``: mend every row without looking, the same draws with no read from the device, so the
    draw can run inside a captured CUDA graph.
    """
    cdf = probs.cumsum(dim=-1)  # [n, V]
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], dtype=cdf.dtype, device=cdf.device)
    draws = uniforms.to(dtype=cdf.dtype, device=cdf.device)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, draws, right=True).squeeze(1)  # first position with cdf > draw
    overflow = index >= probs.shape[1]  # the draw rounded up to the row's total: its last possible token
    if not host_check or bool(overflow.any()):
        last = probs.shape[1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
        index = torch.where(overflow, last, index)
    return index


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens``: ``logits`` ``[n, V]``, ``tokens`` long ``[n]``
    → fp32 ``[n]``. ``temperature <= 0`` (greedy) scores under the unscaled logits."""
    scaled = logits.to(torch.float32)
    if temperature > 0 and temperature != 1.0:
        scaled = scaled / temperature
    chosen = scaled.gather(-1, tokens[:, None].to(scaled.device)).squeeze(-1)
    return chosen - torch.logsumexp(scaled, dim=-1)
