"""Which of the decoder server's requests go together: the per-turn token budget, the sampling settings
a batch shares, and the *cohorts* (the sequences one batch produced, whose next turns continue its KV
cache; :mod:`.server`'s docstring says how a batch is formed and how long a cohort waits)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

#: how long the server waits for more requests after the last one arrived before it decodes a batch
BATCH_WINDOW_S = 0.05
#: most time a request waits for others to join its batch
MAX_WAIT_S = 0.5
#: a cohort waits for its stragglers at most this share of the time its last batch took to decode
COHORT_WAIT_SHARE = 0.02


def cohort_wait(decode_seconds: float, batch_window_s: float = BATCH_WINDOW_S) -> float:
    """Seconds after the first of a cohort's next turns arrived before its batch may start without the
    sequences that have not come back: ``COHORT_WAIT_SHARE`` of the cohort's last decoding time, at least
    ``batch_window_s``, at most ``MAX_WAIT_S``. A straggler left out costs a prefill of its whole context,
    which grows with the decoding time; waiting for a trajectory that ended costs idle time, bounded by
    the share."""
    return min(MAX_WAIT_S, max(batch_window_s, COHORT_WAIT_SHARE * decode_seconds))


def turn_budget(prompt_length: int, sampling_params: dict[str, Any], *, max_model_len: int, prompt_budget: int,
                response_length: int) -> int:
    """Most tokens this turn may sample: SGLang's rule in verl (module docstring). Raises
    ``ValueError`` when the prompt alone exceeds the context. ``sampling_params`` loses its
    ``max_new_tokens``/``max_tokens`` key, as it does there."""
    possible = max_model_len - prompt_length - 1
    if possible < 0:
        raise ValueError(f"prompt of {prompt_length} tokens exceeds the model's context of {max_model_len}")
    if "max_new_tokens" in sampling_params:
        wanted = sampling_params.pop("max_new_tokens")
    elif "max_tokens" in sampling_params:
        wanted = sampling_params.pop("max_tokens")
    else:
        wanted = min(response_length, prompt_budget + response_length - prompt_length)
    return max(0, min(int(wanted), possible))


@dataclass(frozen=True)
class SamplingKey:
    """Requests decoded in one batch share these (one decoder, and its cache, per key)."""

    temperature: float
    top_p: float
    top_k: int

    @classmethod
    def of(cls, params: dict[str, Any]) -> SamplingKey:
        penalty = float(params.get("repetition_penalty", 1.0) or 1.0)
        if penalty != 1.0:
            raise ValueError(f"repetition_penalty={penalty} is not supported by the decoder server")
        top_k = params.get("top_k", -1)
        return cls(float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0) or 1.0),
                   int(top_k) if top_k not in (None, 0) else -1)


#: tokens of a sequence's tail that index it (a lookup compares whole sequences only on a match)
_TAIL = 8


@dataclass(eq=False)
class Cohort:
    """The sequences one batch produced, and the decoder whose KV cache holds them."""

    key: SamplingKey
    decoder: Any
    rows: list[str] = field(default_factory=list)  # each cache row's uid, in the decoder's row order
    finished: float = 0.0  # when its last batch ended (monotonic)
    decode_seconds: float = 0.0  # how long that batch decoded
    _produced: dict[tuple[int, ...], list[str]] = field(default_factory=dict)  # sequence → the rows holding it
    _index: dict[tuple[int, tuple[int, ...]], list[tuple[int, ...]]] = field(default_factory=dict)  # (length, tail)
    _lengths: list[int] = field(default_factory=list)  # the sequences' lengths, longest first

    def update(self, produced: list[tuple[tuple[int, ...], str]], decode_seconds: float) -> None:
        """The batch just decoded: ``(sequence, uid)`` per cache row, in row order."""
        self.rows = [uid for _, uid in produced]
        self.decode_seconds, self.finished = decode_seconds, time.monotonic()
        self._produced, self._index = {}, {}
        for seq, uid in produced:
            if seq not in self._produced:
                self._index.setdefault((len(seq), seq[-_TAIL:]), []).append(seq)
            self._produced.setdefault(seq, []).append(uid)
        self._lengths = sorted({n for n, _ in self._index}, reverse=True)

    def find(self, prompt: list[int]) -> list[str]:
        """The rows holding the longest sequence of the cohort that ``prompt`` starts with (``[]``: none)."""
        for n in self._lengths:
            if n <= len(prompt):
                seqs = self._index.get((n, tuple(prompt[max(0, n - _TAIL) : n])), ())
                head = tuple(prompt[:n]) if seqs else None
                if head in seqs:
                    return self._produced[head]
        return []


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    budget: int
    key: SamplingKey
    want_log_probs: bool
    done: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    cohort: Cohort | None = None  # whose cache it continues (found on arrival; cleared once that cache moved on)
