"""The unified QA row every reader produces and every later stage consumes.

A row is a plain dict (it travels through pandas, JSON lines and parquet)::

    {"id": "mintaka:fae46b21",          # globally unique: "<data_source>:<native id>"
     "question": "Which films did Mel Brooks direct?",
     "ground_truth": [["Blazing Saddles"], ["Young Frankenstein", "Young Frankenstein (film)"]],
     "data_source": "mintaka",
     "split": "test"}

``ground_truth`` is a list of entities; each entity is a list of surface forms, canonical first.
An entity is found when *any* of its surface forms matches (see ``algorithms.matching``).
"""

from __future__ import annotations

from typing import Any, TypedDict

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
