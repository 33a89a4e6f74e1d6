"""Read one finished trajectory (token ids + response mask) into per-step records for the rewards.

verl-free on purpose (only a tokenizer-like ``decode``), so the same code serves the reward manager,
the tests and the benchmark. Observation text is split into the retrieved documents it carries; only
those feed entity discovery, never the model's own turn text: the SPADER reference code also matched
its echoed queries, so a guessed name in a query earned reward (docs/algorithms.md).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spader_pipeline.agent.protocol import OBSERVATION_CLOSE, OBSERVATION_OPEN, parse_turn
from spader_pipeline.algorithms.matching import AnswerScore, score_answers

__all__ = [
    "MASK_FIELD",
    "SEARCH_CALLS_FIELD",
    "SEARCH_ERRORS_FIELD",
    "StepRecord",
    "TrajectoryRecord",
    "documents_in_observation",
    "read_trajectory",
]

#: Agent-loop extra field carrying the response's model-token mask (1 model, 0 observation) to the
#: reward manager. Not ``response_mask``: verl copies every extra field into the batch's non-tensor
#: part, where that name would collide with its own ``response_mask`` tensor.
MASK_FIELD = "spader_response_mask"
#: Agent-loop extra fields: searches sent to the retrieval service, and how many of them failed.
SEARCH_CALLS_FIELD, SEARCH_ERRORS_FIELD = "search_calls", "search_errors"

# One retrieved document per line, as rendered by agent.protocol.format_observation.
_DOC_LINE = re.compile(r"^Doc \d+ \(Title: (.*)$", re.MULTILINE)
_OBS_BLOCK = re.compile(re.escape(OBSERVATION_OPEN) + r"(.*?)" + re.escape(OBSERVATION_CLOSE), re.DOTALL)
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def documents_in_observation(text: str) -> list[str]:
    """The retrieved documents (``"title) contents"`` lines) inside an observation text.

    Framing (chat-template role words, "Results for query k", system notes, error messages) is dropped.
    """
    return [m.group(1) for m in _DOC_LINE.finditer(text)]


def _doc_key(doc: str) -> str:
    return hashlib.blake2b(doc.encode("utf-8"), digest_size=8).hexdigest()


@dataclass(frozen=True)
class StepRecord:
    """One decision step: the model turn and the observation that followed it (if any)."""

    text: str
    kind: str
    num_queries: int  # queries actually executed (0 when no observation followed)
    documents: tuple[str, ...]
    think: str

    @property
    def document_keys(self) -> tuple[str, ...]:
        return tuple(_doc_key(d) for d in self.documents)


@dataclass(frozen=True)
class TrajectoryRecord:
    """Per-step records plus the final-answer score of one trajectory."""

    steps: tuple[StepRecord, ...]
    answers: tuple[str, ...] | None
    score: AnswerScore
    format_ok: bool
    split: str = "mask"  # "mask": steps from response_mask; "text": from <tool_response> blocks
    extra: dict[str, Any] = field(default_factory=dict)


def _runs(mask: torch.Tensor, value: bool) -> list[tuple[int, int]]:
    m = (mask != 0) if value else (mask == 0)
    if m.numel() == 0:
        return []
    padded = torch.nn.functional.pad(m.to(torch.int8), (1, 1))
    diff = padded[1:] - padded[:-1]
    starts = (diff == 1).nonzero().flatten().tolist()
    ends = (diff == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends, strict=True))


def read_trajectory(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor | None,
    ground_truth: Sequence[Sequence[str]],
    decode: Any,
) -> TrajectoryRecord:
    """Split one valid (unpadded) response into steps and score its final answer.

    Args:
        response_ids: long ``[L]`` valid response tokens.
        response_mask: ``[L]`` (1 model, 0 observation); ``None`` falls back to splitting the decoded
            text on ``<tool_response>`` blocks (weaker: a model could forge such a block).
        ground_truth: ``[[alias, ...], ...]``.
        decode: ``decode(ids) -> str`` (e.g. ``lambda ids: tok.decode(ids, skip_special_tokens=True)``).
    """
    turns: list[str] = []
    observations: list[str | None] = []
    if response_mask is not None:
        model_runs = _runs(response_mask, True)
        obs_runs = _runs(response_mask, False)
        for a, b in model_runs:
            turns.append(decode(response_ids[a:b].tolist()))
            following = next((o for o in obs_runs if o[0] == b), None)
            observations.append(
                decode(response_ids[following[0] : following[1]].tolist()) if following else None
            )
    else:
        text = decode(response_ids.tolist())
        pos = 0
        for m in _OBS_BLOCK.finditer(text):
            turns.append(text[pos : m.start()])
            observations.append(m.group(0))
            pos = m.end()
        if text[pos:].strip() or not turns:
            turns.append(text[pos:])
            observations.append(None)
    steps = []
    for turn, obs in zip(turns, observations, strict=True):
        parsed = parse_turn(turn)
        executed = obs is not None and parsed.kind == "search"
        think = " ".join(m.group(1).strip() for m in _THINK.finditer(turn))
        steps.append(
            StepRecord(
                text=turn,
                kind=parsed.kind,
                num_queries=len(parsed.queries) if executed else 0,
                documents=tuple(documents_in_observation(obs)) if obs else (),
                think=think,
            )
        )
    final = parse_turn(steps[-1].text) if steps else None
    format_ok = final is not None and final.kind == "answer"
    answers = final.answers if format_ok else None
    split = "mask" if response_mask is not None else "text"
    return TrajectoryRecord(tuple(steps), answers, score_answers(answers, ground_truth), format_ok, split)
