"""The unified QA row every reader produces and every later stage consumes.

A row is a plain dict (it travels through pandas, JSON lines and parquet)::

    {"id": "mintaka:fae46b21",          # globally unique: "<data_source>:<native id>"
     "question": "Which films did Mel Brooks direct?",
     "ground_truth": [["Blazing Saddles"], ["Young Frankenstein", "Young Frankenstein (film)"]],
     "data_source": "mintaka",
     "split": "test"}

``ground_truth`` is a list of entities; each entity is a list of surface forms, canonical first.
An entity is found when *any* of its surface forms matches (see ``algorithms.matching``).

What every later stage writes per sample — the questions a training or evaluation samples, and
what the agent did on one — is a :class:`SampleRecord`, built by :func:`sample_record`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from spader_pipeline.agent.types import Trajectory

SPLITS = ("train", "validation", "test")
UNIFIED_COLUMNS = ("id", "question", "ground_truth", "data_source", "split")
#: Extra keys of a row that stands for an unreadable input line: why (``invalid_json``,
#: ``not_an_object``) and the raw text; validation quarantines such rows with exactly that.
PARSE_ERROR, RAW_RECORD = "parse_error", "raw_record"


class QARow(TypedDict):
    id: str
    question: str
    ground_truth: list[list[str]]
    data_source: str
    split: str


class SampleRecord(TypedDict, total=False):
    """One sample as the later stages write it: the question (a :class:`QARow` without its split)
    and, after a rollout, what the agent did."""

    id: str
    question: str
    ground_truth: list[list[str]]
    data_source: str | None
    status: str
    """evaluation: ``ok``, or ``failed`` after its retries"""
    finish_reason: str
    history: list[dict[str, str]]
    """the trajectory's chat messages, prompt first"""
    predicted: list[str] | None
    """the final answer; ``None`` when the agent gave no valid one"""


def sample_record(
    sample: Mapping[str, Any], trajectory: Trajectory | None = None, *, status: str | None = None
) -> SampleRecord:
    """The record of ``sample`` (any mapping with ``id``, ``question``, ``ground_truth`` and
    optionally ``data_source``), with ``status`` and the outcome of ``trajectory`` when given."""
    record: SampleRecord = {
        "id": str(sample["id"]),
        "question": str(sample["question"]),
        "ground_truth": ground_truth_lists(sample["ground_truth"]),
        "data_source": sample.get("data_source"),
    }
    if status is not None:
        record["status"] = status
    if trajectory is not None:
        record["finish_reason"] = trajectory.finish_reason
        record["history"] = trajectory.messages
        record["predicted"] = list(trajectory.predicted) if trajectory.predicted is not None else None
    return record


def frame_records(frame: Any) -> list[SampleRecord]:
    """:func:`sample_record` of every row of a pandas frame (an evaluation or training set)."""
    return [sample_record(row) for row in frame.to_dict(orient="records")]


def ground_truth_lists(value: Any) -> list[list[str]]:
    """``QARow.ground_truth`` as plain Python lists of strings, from what storage hands back: lists,
    numpy arrays (parquet round trips) or a flat list of names (each name its own entity)."""
    return [[entity] if isinstance(entity, str) else [str(form) for form in entity] for entity in list(value)]


def make_id(data_source: str, native_id: Any) -> str:
    """Globally unique id: the data source name, a colon, and the source's own id."""
    return f"{data_source}:{native_id}"


def dedupe_forms(forms: list[Any]) -> list[str]:
    """Surface forms as stripped strings, order kept, exact duplicates removed.

    Non-string values (numbers, booleans from value answers) become strings; ``None`` and empty
    strings are kept out here and so show up as an entity with no surface form, which validation
    quarantines with a reason.
    """
    out: list[str] = []
    for form in forms:
        if form is None:
            continue
        text = str(form).strip()
        if text and text not in out:
            out.append(text)
    return out
