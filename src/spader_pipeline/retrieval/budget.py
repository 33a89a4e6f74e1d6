"""The character budget of SPADER-style responses (its retrieval server; docs/retrieval.md), made to hold exactly.

The reference walks candidates rank-major (every query's rank-0 passage, then every rank-1
passage, ...) and stops at the first one that does not fit, but it measures each passage at
the wrong indentation, so the delivered JSON can exceed ``max_chars`` by hundreds of characters.

Here the cost of each passage is its exact contribution to the delivered text
``json.dumps(body, indent=2, ensure_ascii=False)`` where ``body = {"result": [{"query", "documents"}],
"truncation_warning"?}`` — the longest rendering any published client shows the model (the
compact wire form and the eval client's ``result`` + warning line are both shorter). The
warning's own length is reserved as soon as anything is dropped. A passage that does not fit
closes its query (so every query keeps a rank prefix: no gaps) but, unlike the reference, the walk
goes on with the other queries, which may still fit smaller passages. A final render check
guarantees the bound even if the arithmetic were ever off.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

ENTRY_DEPTH_INDENT = 8  # a passage sits at body > result > [i] > documents > [j]: 4 levels × 2 spaces


def render(body: Any) -> str:
    """The reference text form of a response body (what the SPADER training client shows)."""
    return json.dumps(body, indent=2, ensure_ascii=False)


def truncation_warning(max_chars: int) -> str:
    return f"System Note: Retrieval results truncated at {max_chars} characters."


_encode_str = json.JSONEncoder(ensure_ascii=False).encode  # C-accelerated for plain strings


def rendered_length(value: Any, level: int = 0) -> int:
    """``len(json.dumps(value, indent=2, ensure_ascii=False))`` for ``value`` nested ``level`` deep,
    computed without rendering: strings and numbers through the C encoder, structure by counting.

    Python's json module renders ``indent=`` output in pure Python (slow); this is ~10x faster and
    exact (a property test compares the two on arbitrary JSON values).
    """
    if isinstance(value, str):
        return len(_encode_str(value))
    if value is None or isinstance(value, bool):
        return 4 if value is None or value is True else 5
    if isinstance(value, int | float):
        return len(json.dumps(value))
    inner = 2 * (level + 1)
    if isinstance(value, dict):
        if not value:
            return 2
        items = sum(len(_encode_str(str(k))) + 2 + rendered_length(v, level + 1) for k, v in value.items())
    elif isinstance(value, list | tuple):
        if not value:
            return 2
        items = sum(rendered_length(v, level + 1) for v in value)
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")
    n = len(value)
    # "{" + n × ("\n" + indent) + items + (n - 1) commas + "\n" + closing indent + "}"
    return 2 + n * (1 + inner) + items + (n - 1) + 1 + 2 * level


def entry_cost(entry: Any, first: bool) -> int:
    """Characters that appending ``entry`` to a query's ``documents`` list adds to :func:`render`.

    The entry sits 4 levels deep (body > result > [i] > documents > [j]). ``first``: the list was
    empty (``[]`` becomes ``[\n<indent><entry>\n<closing indent>]``); otherwise a ``,\n<indent>``
    separator is added.
    """
    body = rendered_length(entry, 4) + ENTRY_DEPTH_INDENT  # the entry and its leading indentation
    return body + (1 + 1 + 6 if first else 2)


def spader_body(queries: Sequence[str], documents: Sequence[Sequence[Any]], warning: str | None) -> dict:
    body: dict[str, Any] = {"result": [{"query": q, "documents": list(d)} for q, d in zip(queries, documents, strict=True)]}
    if warning is not None:
        body["truncation_warning"] = warning
    return body


class BudgetTooSmall(ValueError):
    """``max_chars`` cannot even hold the echoed queries with no passages."""


def apply_budget(queries: Sequence[str], candidates: Sequence[Sequence[Any]], max_chars: int | None) -> dict:
    """The SPADER response body for ``candidates`` (per query, rank order) within ``max_chars``.

    Returns ``{"result": [...], "truncation_warning"?}`` with
    ``len(render(result)) <= max_chars`` whenever ``max_chars > 0`` (``None`` or ``<= 0``: no budget).
    Raises :class:`BudgetTooSmall` when the skeleton (plus the warning, if anything must be
    dropped) does not fit.
    """
    if max_chars is None or max_chars <= 0:
        return spader_body(queries, candidates, None)
    skeleton = rendered_length(spader_body(queries, [[] for _ in queries], None))
    if skeleton > max_chars:
        raise BudgetTooSmall(
            f"max_chars={max_chars} is smaller than the response skeleton for these queries ({skeleton} characters)"
        )
    costs = [[entry_cost(e, first=(r == 0)) for r, e in enumerate(docs)] for docs in candidates]
    if skeleton + sum(map(sum, costs)) <= max_chars:
        body = spader_body(queries, candidates, None)
    else:
        warning = truncation_warning(max_chars)
        reserve = rendered_length({"result": [], "truncation_warning": warning}) - rendered_length({"result": []})
        budget = max_chars - reserve - skeleton
        if budget < 0:
            raise BudgetTooSmall(
                f"max_chars={max_chars} cannot hold these queries' response skeleton plus the truncation "
                f"warning ({skeleton + reserve} characters)"
            )
        kept = [0] * len(queries)
        open_ = [True] * len(queries)
        depth = max((len(d) for d in candidates), default=0)
        for rank in range(depth):  # rank-major round robin
            for q, docs in enumerate(candidates):
                if not open_[q] or rank >= len(docs):
                    continue
                if costs[q][rank] <= budget:
                    budget -= costs[q][rank]
                    kept[q] += 1
                else:
                    open_[q] = False  # keep a rank prefix per query
        body = spader_body(queries, [docs[:k] for docs, k in zip(candidates, kept, strict=True)], warning)
    # Safety net: never deliver more than the budget, whatever the walk above did.
    while rendered_length(body) > max_chars:
        lists = [r["documents"] for r in body["result"]]
        longest = max(range(len(lists)), key=lambda i: len(lists[i]))
        if not lists[longest]:
            raise BudgetTooSmall(f"max_chars={max_chars} cannot hold the response skeleton")
        lists[longest].pop()
        body.setdefault("truncation_warning", truncation_warning(max_chars))
    return body
