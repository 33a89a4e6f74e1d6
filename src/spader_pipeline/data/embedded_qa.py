"""The embedded default QA set, built deterministically from Wikipedia short descriptions.

Articles that share a short description form one multi-answer question: the 13 articles
described as "Country in West Africa" become *Which countries are in West Africa?* with the 13
titles as the answer set. Every passage of those articles starts with that description (see
``wiki.iter_passages``), so membership is decidable from what the agent retrieves. Articles
whose description is unique become single-answer questions (training signal for copying titles
out of observations, see ``docs/data.md``); ``single_answer.per_multi_answer`` caps them per split
relative to the multi-answer questions, so they do not outnumber the task itself. Splits (and that
selection) are assigned by a salted hash of the description, so they never change when other
groups are added or removed.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from typing import Any

import pandas as pd

from spader_pipeline.data.readers import title_aliases
from spader_pipeline.data.schema import QARow, make_id

DATA_SOURCE = "embedded"
logger = logging.getLogger(__name__)

_PLURAL_RANKS = {
    "family": "families",
    "genus": "genera",
    "order": "orders",
    "class": "classes",
    "species": "species",
    "subphylum": "subphyla",
    "phylum": "phyla",
    "subfamily": "subfamilies",
}

# (pattern on the description, question template). First match wins; groups are named.
_QUESTION_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^Country in (?P<region>.+)$"), "Which countries are in {region}?"),
    (re.compile(r"^Play by (?P<author>.+)$"), "Which plays were written by {author}?"),
    (re.compile(r"^(?P<kind>.+) language$"), "Which languages are classified as {kind} languages?"),
    (
        re.compile(r"^(?P<rank>Family|Genus|Order|Class|Species|Subphylum|Phylum|Subfamily) of (?P<taxon>.+)$"),
        "Which {ranks} of {taxon} are there?",
    ),
)


def _quoted(description: str) -> str:
    # Descriptions may contain double quotes; the question quotes the description itself.
    return '"' + description.replace('"', "'") + '"'


def multi_answer_question(description: str) -> str:
    """A natural question for a shared description, or the generic short-description form."""
    for pattern, template in _QUESTION_RULES:
        match = pattern.match(description)
        if match:
            fields = match.groupdict()
            if "rank" in fields:
                fields["ranks"] = _PLURAL_RANKS[fields["rank"].lower()]
            return template.format(**fields)
    return f"Which Wikipedia articles have the short description {_quoted(description)}?"


def single_answer_question(description: str) -> str:
    return f"Which Wikipedia article has the short description {_quoted(description)}?"


def _stable_fraction(key: str, salt: str) -> float:
    digest = hashlib.sha1(f"{salt}|{key}".encode()).hexdigest()
    return int(digest[:12], 16) / float(16**12)


def assign_split(key: str, fractions: Mapping[str, float], salt: str) -> str:
    """Deterministic split for ``key`` given ``{split: fraction}`` (fractions sum to 1)."""
    total = sum(fractions.values())
    if total <= 0:
        raise ValueError("split fractions must sum to a positive number")
    point = _stable_fraction(key, salt) * total
    cumulative = 0.0
    for split, fraction in fractions.items():
        cumulative += fraction
        if point < cumulative:
            return split
    return next(reversed(fractions))


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def build_embedded_qa(articles: pd.DataFrame, params: Mapping[str, Any]) -> list[QARow]:
    """Unified QA rows from articles (``title, description`` columns).

    ``params``: ``min_answers`` / ``max_answers`` bound a multi-answer group's size;
    ``splits`` are the fractions for multi-answer questions; ``single_answer.enabled`` and
    ``single_answer.splits`` control the single-answer questions; ``salt`` seeds the split hash.
    ``single_answer.per_multi_answer`` (null: no cap) keeps at most that many single-answer
    questions per multi-answer question of the same split: those whose salted hash is lowest, so
    the choice is as stable as the splits.
    """
    salt = str(params.get("salt", "spader"))
    min_answers = int(params.get("min_answers", 2))
    max_answers = int(params.get("max_answers", 50))
    single = params.get("single_answer", {}) or {}

    described = articles[articles["description"].str.len() > 0]
    rows: list[QARow] = []
    for description, group in described.groupby("description", sort=True):
        titles = sorted(group["title"])
        if min_answers <= len(titles) <= max_answers:
            rows.append(
                {
                    "id": make_id(DATA_SOURCE, f"group-{_short_hash(description)}"),
                    "question": multi_answer_question(description),
                    "ground_truth": [title_aliases(title) for title in titles],
                    "data_source": DATA_SOURCE,
                    "split": assign_split(description, params["splits"], salt),
                }
            )
        elif len(titles) == 1 and single.get("enabled", True):
            rows.append(
                {
                    "id": make_id(DATA_SOURCE, f"single-{_short_hash(description)}"),
                    "question": single_answer_question(description),
                    "ground_truth": [title_aliases(titles[0])],
                    "data_source": DATA_SOURCE,
                    "split": assign_split(description, single["splits"], salt),
                }
            )
    return _cap_single_answer(rows, single.get("per_multi_answer"), salt)


def _cap_single_answer(rows: list[QARow], per_multi_answer: float | None, salt: str) -> list[QARow]:
    """Keep at most ``per_multi_answer`` single-answer rows per multi-answer row of each split."""
    if per_multi_answer is None:
        return rows
    if per_multi_answer < 0:
        raise ValueError("single_answer.per_multi_answer must be >= 0 (or null: no cap)")
    multi = [r for r in rows if len(r["ground_truth"]) >= 2]
    kept = []
    for split in dict.fromkeys(r["split"] for r in rows):
        cap = int(round(per_multi_answer * sum(r["split"] == split for r in multi)))
        single = [r for r in rows if r["split"] == split and len(r["ground_truth"]) == 1]
        kept += sorted(single, key=lambda r: _stable_fraction(r["id"], f"{salt}|cap"))[:cap]
    chosen = {r["id"] for r in kept}
    single_total = len(rows) - len(multi)
    logger.info("embedded QA: %d multi-answer questions, %d of %d single-answer ones kept "
                "(single_answer.per_multi_answer: %s)", len(multi), len(chosen), single_total, per_multi_answer)
    return [r for r in rows if len(r["ground_truth"]) >= 2 or r["id"] in chosen]
