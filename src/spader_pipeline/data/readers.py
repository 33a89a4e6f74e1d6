"""Readers for the native formats of the benchmarks the SPADER paper evaluates on, plus our own.

Each reader turns one file into unified rows (``data.schema``). Readers are lenient on purpose:
a malformed record still becomes a row (with whatever could be read, e.g. an empty question or
an entity without surface forms) so that validation can quarantine it *with a reason* instead
of the reader dropping it silently. Only an unreadable file (bad JSON at the top level) raises.

Native formats:

- QAMPARI  (jsonl): ``{"qid", "question_text", "answer_list": [{"answer_text", "aliases": [...]}, ...]}``
- Mintaka  (json list): ``{"id", "question", "answer": {"answerType", "answer": [entity | value],
  "supportingEnt"?: [entity]}}`` where an entity is ``{"name": QID, "label": {"en": str, ...}}``
- WebQSP   (json): ``{"Questions": [{"QuestionId", "RawQuestion"/"ProcessedQuestion",
  "Parses": [{"Answers": [{"AnswerType", "AnswerArgument", "EntityName"}]}]}]}``
- QUEST    (jsonl): ``{"query", "docs": [Wikipedia titles], ...}``
- unified  (jsonl): ``{"id", "question", "ground_truth": [[aliases]], "data_source"?, "split"?}``
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from spader_pipeline.data.schema import PARSE_ERROR, RAW_RECORD, QARow, dedupe_forms, make_id

logger = logging.getLogger(__name__)

_PARENTHETICAL = re.compile(r"\s*\([^()]*\)\s*$")


def title_aliases(title: str) -> list[str]:
    """A Wikipedia title and, when it carries a disambiguator, the bare name.

    ``"Mercury (planet)"`` → ``["Mercury (planet)", "Mercury"]``.
    """
    bare = _PARENTHETICAL.sub("", title).strip()
    return dedupe_forms([title, bare])


class InvalidLine(str):
    """The raw text of a JSON-lines line that is not valid JSON."""


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, parsed)``; an unparsable line yields ``(line_number, InvalidLine(raw))``."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d is not valid JSON; it will be quarantined", path, number)
                yield number, InvalidLine(line.rstrip("\n"))


def _unparsable(data_source: str, split: str, number: int, record: Any) -> dict[str, Any]:
    """The row standing for a line or item that is not a JSON object. Validation quarantines it with
    the reason ``PARSE_ERROR`` (``invalid_json`` or ``not_an_object``) and the raw text as its record."""
    if isinstance(record, InvalidLine):
        reason, raw = "invalid_json", str(record)
    else:
        reason, raw = "not_an_object", json.dumps(record, ensure_ascii=False, default=str)
    return {
        "id": make_id(data_source, f"line{number}"),
        "question": "",
        "ground_truth": [],
        "data_source": data_source,
        "split": split,
        PARSE_ERROR: reason,
        RAW_RECORD: raw,
    }


def _collect(
    items: Iterable[tuple[int, Any]], data_source: str, split: str, parse: Callable[[int, dict], dict[str, Any]]
) -> list[QARow]:
    """One row per ``(number, record)``: ``parse`` reads a JSON object into ``id``, ``question`` and
    ``ground_truth`` (and may override ``data_source``/``split``); anything else becomes an
    unparsable row that validation quarantines."""
    rows: list[QARow] = []
    for number, record in items:
        if isinstance(record, dict):
            rows.append({"data_source": data_source, "split": split, **parse(number, record)})
        else:
            rows.append(_unparsable(data_source, split, number, record))
    return rows


def read_qampari(path: Path, data_source: str, split: str) -> list[QARow]:
    def parse(number: int, record: dict) -> dict[str, Any]:
        entities = [
            dedupe_forms([answer.get("answer_text"), *(answer.get("aliases") or [])]) if isinstance(answer, dict) else []
            for answer in record.get("answer_list") or []
        ]
        return {"id": make_id(data_source, record.get("qid", f"line{number}")),
                "question": str(record.get("question_text") or "").strip(), "ground_truth": entities}

    return _collect(_iter_jsonl(path), data_source, split, parse)


def _mintaka_surface_forms(item: Any) -> list[str]:
    """Surface forms of one Mintaka answer item: an entity's English label, or a literal value
    (number, date, string, boolean) as a string."""
    if isinstance(item, dict):
        label = item.get("label")
        if isinstance(label, dict):
            return dedupe_forms([label.get("en")])
        return dedupe_forms([label])
    return dedupe_forms([item])


def read_mintaka(path: Path, data_source: str, split: str, count_as: str = "entities") -> list[QARow]:
    """Mintaka v1.x JSON. For count questions, ``count_as="entities"`` uses the supporting
    entities as the answer set (the multi-answer reading), ``"number"`` keeps the count."""
    with path.open(encoding="utf-8") as handle:
        records = json.load(handle)
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of Mintaka questions")

    def parse(number: int, record: dict) -> dict[str, Any]:
        answer = record.get("answer") or {}
        items = answer.get("answer") if isinstance(answer, dict) else None
        supporting = answer.get("supportingEnt") if isinstance(answer, dict) else None
        if count_as == "entities" and supporting:
            items = supporting
        return {"id": make_id(data_source, record.get("id", f"item{number}")),
                "question": str(record.get("question") or "").strip(),
                "ground_truth": [_mintaka_surface_forms(item) for item in (items or [])]}

    return _collect(enumerate(records, start=1), data_source, split, parse)


def read_webqsp(path: Path, data_source: str, split: str) -> list[QARow]:
    """WebQSP JSON; answers are the union over a question's parses, deduplicated by argument."""
    with path.open(encoding="utf-8") as handle:
        document = json.load(handle)
    questions = document.get("Questions") if isinstance(document, dict) else None
    if not isinstance(questions, list):
        raise ValueError(f"{path}: expected a WebQSP object with a 'Questions' list")

    def parse(number: int, question: dict) -> dict[str, Any]:
        entities: list[list[str]] = []
        seen: set[str] = set()
        for parse_ in question.get("Parses") or []:
            for answer in (parse_ or {}).get("Answers") or []:
                if not isinstance(answer, dict):
                    entities.append([])
                    continue
                argument = str(answer.get("AnswerArgument") or "")
                if argument and argument in seen:
                    continue
                seen.add(argument)
                if answer.get("AnswerType") == "Entity":
                    # A Freebase MID is not a surface form: an entity without a name stays empty
                    # and is quarantined by validation rather than matched against "m.0xyz".
                    entities.append(dedupe_forms([answer.get("EntityName")]))
                else:
                    entities.append(dedupe_forms([answer.get("EntityName"), argument]))
        text = question.get("RawQuestion") or question.get("ProcessedQuestion") or ""
        return {"id": make_id(data_source, question.get("QuestionId", f"q{number}")),
                "question": str(text).strip(), "ground_truth": entities}

    return _collect(enumerate(questions, start=1), data_source, split, parse)


def read_quest(path: Path, data_source: str, split: str) -> list[QARow]:
    """QUEST jsonl: the answer set is the list of relevant Wikipedia titles (``docs``)."""

    def parse(number: int, record: dict) -> dict[str, Any]:
        return {"id": make_id(data_source, f"{split}-{number}"),
                "question": str(record.get("query") or "").strip(),
                "ground_truth": [title_aliases(str(d)) if d else [] for d in record.get("docs") or []]}

    return _collect(_iter_jsonl(path), data_source, split, parse)


def read_unified(path: Path, data_source: str, split: str) -> list[QARow]:
    """Our own jsonl (also the reference evaluation format: ``question_text`` is accepted)."""

    def parse(number: int, record: dict) -> dict[str, Any]:
        raw_truth = record.get("ground_truth")
        if isinstance(raw_truth, list):
            truth = [dedupe_forms(entity if isinstance(entity, list) else [entity]) for entity in raw_truth]
        else:
            truth = raw_truth  # left as is: validation reports the wrong type
        source = record.get("data_source") or data_source
        native = str(record.get("id", f"line{number}"))
        return {"id": native if native.startswith(f"{source}:") else make_id(source, native),
                "question": str(record.get("question") or record.get("question_text") or "").strip(),
                "ground_truth": truth, "data_source": source, "split": record.get("split") or split}

    return _collect(_iter_jsonl(path), data_source, split, parse)


READERS: dict[str, Callable[..., list[QARow]]] = {
    "qampari": read_qampari,
    "mintaka": read_mintaka,
    "webqsp": read_webqsp,
    "quest": read_quest,
    "unified": read_unified,
}


def read_dataset(spec: dict[str, Any], project_path: Path | None = None) -> list[QARow]:
    """Read one configured dataset.

    ``spec``: ``{"name", "format", "path", "split", "optional": bool, "options": {...}}``. A missing
    optional file is skipped with a logged message; a missing required file raises.
    """
    fmt = spec.get("format", spec["name"])
    if fmt not in READERS:
        raise ValueError(f"dataset {spec['name']!r}: unknown format {fmt!r}; known: {sorted(READERS)}")
    path = Path(spec["path"])
    if project_path is not None and not path.is_absolute():
        path = project_path / path
    if not path.exists():
        if spec.get("optional", True):
            logger.info("dataset %s: %s not found, skipped (optional)", spec["name"], path)
            return []
        raise FileNotFoundError(f"dataset {spec['name']!r}: required file {path} not found")
    rows = READERS[fmt](path, spec.get("data_source", spec["name"]), spec.get("split", "test"), **spec.get("options", {}))
    logger.info("dataset %s: read %d rows from %s", spec["name"], len(rows), path)
    return rows
