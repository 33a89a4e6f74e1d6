"""The text protocol between a search agent and its environment.

One assistant turn is free text (usually ``<think>…</think>``) followed by exactly one action:

* search: ``<tool_call>["query 1", "query 2"]</tool_call>`` — a JSON list of query strings;
* answer: ``<answer>["Entity A", "Entity B"]</answer>`` — a JSON list of entity strings.

The environment answers a search with ONE observation format, :func:`format_observation`, and a
malformed turn with :func:`format_error_observation`. Both are used verbatim by the project's
rollout (:mod:`spader_pipeline.agent.rollout`), by the VERL tool and agent loop
(:mod:`spader_pipeline.verl_plugin`) and therefore by evaluation, so a model sees the same text in
training and at test time (the SPADER reference code, KhanCold/spader, shows the model two different formats).

Everything here is pure and total: parsers never raise, whatever the model wrote.

Parsing rules (:func:`parse_turn`):

* Only complete blocks count. When several action blocks appear (models echo the prompt's example
  inside ``<think>``), the block that *closes last* decides the action.
* Tool-call payload: a JSON list (nested lists are flattened; items are stripped; empty items and
  non-strings other than numbers are dropped), a bare JSON string (one query), or the legacy dict
  ``{"name": "search", "arguments": {"query_list": [...]}}`` (``arguments`` may itself be a JSON
  string). Anything else, or a payload that leaves no query, is an ``invalid`` turn.
* Answer payload: a JSON list of strings (flattened like queries) or a bare JSON string.
  ``<answer>[]</answer>`` is a valid answer with no entities. A Python-literal list
  (``['a', 'b']``) is accepted as a courtesy; free text is a format error.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "OBSERVATION_CLOSE",
    "OBSERVATION_OPEN",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedTurn",
    "TurnKind",
    "count_queries",
    "count_search_calls",
    "extract_last_answer",
    "format_error_observation",
    "format_observation",
    "normalize_string_list",
    "parse_turn",
    "think_text",
    "truncate_observation",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
OBSERVATION_OPEN, OBSERVATION_CLOSE = "<tool_response>", "</tool_response>"

#: The one tool the protocol knows. Legacy dict calls must name it (or name nothing).
SEARCH_TOOL_NAME = "search"

TurnKind = Literal["search", "answer", "invalid"]

_BLOCK_RE = re.compile(r"<(tool_call|answer)>(.*?)</\1>", re.DOTALL)
_THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_NOTE_PREFIX_RE = re.compile(r"^system note:\s*", re.IGNORECASE)
_MAX_ERROR_SNIPPET = 80
_FLATTEN_MAX_DEPTH = 32

#: The instruction appended to every corrective observation.
FORMAT_HINT = (
    'Reply with <tool_call>["query 1", "query 2"]</tool_call> to search, or '
    '<answer>["Entity A", "Entity B"]</answer> to answer. Both must contain a JSON list of strings.'
)


@dataclass(frozen=True)
class ParsedTurn:
    """The action one assistant turn asked for.

    ``kind`` is ``"search"`` (``queries`` non-empty), ``"answer"`` (``answers`` possibly empty) or
    ``"invalid"`` (``error`` says why, in words suitable for the corrective observation).
    """

    kind: TurnKind
    queries: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    error: str | None = None

    @property
    def is_valid(self) -> bool:
        return self.kind != "invalid"


def _invalid(reason: str) -> ParsedTurn:
    return ParsedTurn(kind="invalid", error=reason)


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_SNIPPET else text[: _MAX_ERROR_SNIPPET - 1] + "…"


def normalize_string_list(value: Any) -> tuple[str, ...] | None:
    """Flatten ``value`` into stripped, non-empty strings; ``None`` if it is not list/string data.

    Lists and tuples are flattened recursively (depth-limited); numbers become their ``str``;
    ``None``, booleans, empty strings and dicts inside a list are dropped.
    """
    out: list[str] = []

    def walk(item: Any, depth: int) -> bool:
        if isinstance(item, str):
            stripped = item.strip()
            if stripped:
                out.append(stripped)
            return True
        if isinstance(item, bool) or item is None:
            return True
        if isinstance(item, (int, float)):
            out.append(str(item))
            return True
        if isinstance(item, (list, tuple)):
            if depth >= _FLATTEN_MAX_DEPTH:
                return False
            return all(walk(x, depth + 1) for x in item)
        return True  # dicts and other objects inside a list carry no query text: skip them

    if not isinstance(value, (str, list, tuple)):
        return None
    if not walk(value, 0):
        return None
    return tuple(out)


def _loads(payload: str) -> tuple[Any, str | None]:
    """``json.loads`` that reports instead of raising; falls back to a Python literal list."""
    try:
        return json.loads(payload), None
    except RecursionError:
        return None, "JSON nested too deeply"
    except ValueError as exc:
        json_error = f"invalid JSON ({exc})"
    # Courtesy for single-quoted Python lists only (``['a', 'b']``); never for JSON-looking text.
    if payload.startswith("[") and payload.endswith("]") and "'" in payload and len(payload) < 100_000:
        try:
            value = ast.literal_eval(payload)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        else:
            if isinstance(value, list):
                return value, None
    return None, json_error


def _parse_tool_call(payload: str) -> ParsedTurn:
    payload = payload.strip()
    if not payload:
        return _invalid("the <tool_call> block is empty; it must contain a JSON list of query strings")
    value, error = _loads(payload)
    if error is not None:
        return _invalid(f"the <tool_call> content is not valid JSON: {error}")
    if isinstance(value, Mapping):
        name = value.get("name", SEARCH_TOOL_NAME)
        if name != SEARCH_TOOL_NAME:
            return _invalid(f"unknown tool {_snippet(str(name))!r}; the only tool is {SEARCH_TOOL_NAME!r}")
        arguments = value.get("arguments", value)
        if isinstance(arguments, str):
            arguments, error = _loads(arguments.strip())
            if error is not None:
                return _invalid(f"the tool-call arguments are not valid JSON: {error}")
        if not isinstance(arguments, Mapping):
            return _invalid("the tool-call arguments must be an object with a 'query_list'")
        value = arguments.get("query_list", arguments.get("queries", arguments.get("query")))
        if value is None:
            return _invalid("the tool call has no 'query_list'")
    queries = normalize_string_list(value)
    if queries is None:
        return _invalid(
            f"the <tool_call> content must be a JSON list of query strings, got {type(value).__name__}"
        )
    if not queries:
        return _invalid("the <tool_call> list contains no non-empty query")
    return ParsedTurn(kind="search", queries=queries)


def _parse_answer(payload: str) -> ParsedTurn:
    payload = payload.strip()
    if not payload:
        return _invalid("the <answer> block is empty; it must contain a JSON list of entity strings")
    value, error = _loads(payload)
    answers = normalize_string_list(value) if error is None else None
    if answers is None:
        return _invalid(f"the <answer> content must be a JSON list of strings: {_snippet(payload)!r}")
    return ParsedTurn(kind="answer", answers=answers)


def parse_turn(text: object) -> ParsedTurn:
    """Parse one assistant turn into its action. Never raises (any input, any type)."""
    try:
        if not isinstance(text, str):
            return _invalid(f"the turn is not text ({type(text).__name__})")
        blocks = list(_BLOCK_RE.finditer(text))
        if not blocks:
            for opening, closing in ((TOOL_CALL_OPEN, TOOL_CALL_CLOSE), (ANSWER_OPEN, ANSWER_CLOSE)):
                if opening in text:
                    return _invalid(f"{opening} was opened but never closed with {closing}")
            return _invalid("the turn contains neither a <tool_call> nor an <answer> block")
        kind, payload = blocks[-1].group(1), blocks[-1].group(2)
        return _parse_tool_call(payload) if kind == "tool_call" else _parse_answer(payload)
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
        return _invalid(f"the turn could not be parsed ({exc.__class__.__name__})")


# --------------------------------------------------------------------------------------------------
# Helpers for rewards and metrics
# --------------------------------------------------------------------------------------------------


def count_queries(text: object) -> int:
    """Number of queries the turn's executed tool call carries (0 for answers and invalid turns).

    Only the last block counts, the one the environment executes; tool calls echoed inside
    ``<think>`` (or the prompt's example) are never counted.
    """
    parsed = parse_turn(text)
    return len(parsed.queries) if parsed.kind == "search" else 0


def think_text(text: str) -> str:
    """The turn's reasoning: its ``<think>`` blocks' contents, stripped and joined by a space."""
    return " ".join(m.group(1).strip() for m in _THINK_RE.finditer(text))


def count_search_calls(turns: Iterable[object]) -> int:
    """Number of assistant turns in ``turns`` that performed a search (each turn executes at most one call).

    Pass the assistant turns only: the prompt's example call must not be counted (the SPADER reference's evaluation counted it).
    """
    return sum(1 for t in turns if parse_turn(t).kind == "search")


def extract_last_answer(turns: str | Iterable[object]) -> tuple[str, ...] | None:
    """The answers of the last assistant turn that is a valid ``<answer>``; ``None`` if there is none.

    ``turns`` is either one text (e.g. a decoded response) or the assistant turns of a trajectory.
    For one text, the last complete ``<answer>`` block is used (a later ``<tool_call>`` does not
    hide it). ``()`` means the agent answered with an empty list.
    """
    texts = [turns] if isinstance(turns, str) else list(turns)
    for text in reversed(texts):
        if not isinstance(text, str):
            continue
        matches = [m for m in _BLOCK_RE.finditer(text) if m.group(1) == "answer"]
        for match in reversed(matches):
            parsed = _parse_answer(match.group(2))
            if parsed.kind == "answer":
                return parsed.answers
    return None


# --------------------------------------------------------------------------------------------------
# Observations
# --------------------------------------------------------------------------------------------------


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _one_line(text: Any) -> str:
    return " ".join(str(text if text is not None else "").split())


def _document_line(rank: int, document: Any) -> str:
    title = _one_line(_field(document, "title", ""))
    contents = _one_line(_field(document, "contents", ""))
    return f"Doc {rank} (Title: {title}) {contents}".rstrip()


def truncate_observation(body: str, max_chars: int | None) -> tuple[str, bool]:
    """Keep the head of ``body`` within ``max_chars`` characters (cut at a line end when possible)."""
    if max_chars is None or max_chars <= 0 or len(body) <= max_chars:
        return body, False
    head = body[:max_chars]
    cut = head.rfind("\n")
    if cut > max_chars // 2:
        head = head[:cut]
    return head.rstrip() + " …", True


def format_observation(
    results: Sequence[Any],
    truncation_warning: str | None = None,
    *,
    max_chars: int | None = None,
) -> str:
    """Render search results as the observation the agent reads.

    ``results`` is one entry per query, in the order the queries were issued; each entry has
    ``documents`` (objects or mappings with ``title`` and ``contents``), e.g. the retrieval
    client's ``QueryResult``. The text is::

        <tool_response>
        Results for query 1:
        Doc 1 (Title: Ghana) Country in West Africa. Ghana, officially …
        Doc 2 (Title: …) …
        Results for query 2:
        (no results)
        System note: <truncation warning, when the server cut results>
        </tool_response>

    The query strings are deliberately *not* echoed: the observation then contains only retrieved
    text plus fixed framing, so nothing the model wrote can be mistaken for discovered evidence
    (the SPADER reference paid for entity names echoed from queries). ``max_chars`` optionally caps the body (head kept, closing tag always present).
    """
    lines: list[str] = []
    for q_index, result in enumerate(results, start=1):
        lines.append(f"Results for query {q_index}:")
        documents = list(_field(result, "documents", None) or [])
        if not documents:
            lines.append("(no results)")
        lines.extend(_document_line(rank, doc) for rank, doc in enumerate(documents, start=1))
    body, cut = truncate_observation("\n".join(lines), max_chars)
    notes = []
    if truncation_warning:
        notes.append(_NOTE_PREFIX_RE.sub("", _one_line(truncation_warning)))
    if cut:
        notes.append(f"Results truncated at {max_chars} characters.")
    if notes:
        body += "\nSystem note: " + " ".join(notes)
    return f"{OBSERVATION_OPEN}\n{body}\n{OBSERVATION_CLOSE}"


def format_error_observation(message: str) -> str:
    """The corrective observation for a turn that could not be executed (same framing as results)."""
    return f"{OBSERVATION_OPEN}\nError: {_one_line(message)}\n{FORMAT_HINT}\n{OBSERVATION_CLOSE}"
