"""A multi-search variant of the embedded QA set: unions of description groups (docs/data.md).

Each question is the union of 2–4 *sub-groups*; a sub-group is the set of articles whose short
description, normalised (years, ordinals and parentheses removed: "King of France from 987 to 996"
→ "King of France"), is the same. The sub-groups of one question share a *head* and differ in one
*facet*, which the question names:

- nationality × rest: "French composer", "Czech composer" → *Which Czech or French composers are
  there?*
- "<head> of/in <facet>": "Country in Central Africa", "Country in East Asia" → *Which countries are
  in Central Africa or East Asia?*; "Family of fruit bats", "Family of primates" → *Which families of
  fruit bats or primates are there?*
- "<facet> <head word>": "Cushitic language", "Semitic language" → *Which Cushitic or Semitic
  languages are there?*
- atomic-number windows: *Which chemical elements have atomic numbers from 21 to 30?* (the number is
  in every element's description; a sub-group is a few consecutive numbers).

Every passage starts with its article's description (``wiki.iter_passages``), so membership stays
decidable from retrieved text, and a search for a sub-group's description retrieves that
sub-group: a question needs about one search per sub-group. Sub-groups larger than
``max_subgroup_answers`` are left out (they need more searches than the question has facets), and
no sub-group holds more than ``max_share`` of a question's answers, so the search for one
sub-group finds at most that share.

Splits are assigned per head (a salted hash, as in ``embedded_qa``), so a sub-group, and hence an
answer set, never occurs in two splits.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline.agent.question_grammar import ELEMENT, pluralize
from spader_pipeline.data.embedded_qa import DATA_SOURCE, _short_hash, _stable_fraction, assign_split
from spader_pipeline.data.readers import title_aliases
from spader_pipeline.data.schema import QARow, make_id

logger = logging.getLogger(__name__)

_DEMONYMS = (
    "Ancient Greek|Ancient Roman|South African|New Zealand|American|Argentine|Australian|Austrian|Belgian|"
    "Brazilian|British|Bulgarian|Canadian|Chilean|Chinese|Colombian|Croatian|Cuban|Czech|Danish|Dutch|"
    "Egyptian|English|Finnish|Flemish|French|German|Greek|Hungarian|Indian|Iranian|Irish|Israeli|Italian|"
    "Jamaican|Japanese|Korean|Mexican|Nigerian|Norwegian|Pakistani|Persian|Polish|Portuguese|Prussian|"
    "Roman|Romanian|Russian|Scottish|Serbian|Soviet|Spanish|Swedish|Swiss|Turkish|Ukrainian|Welsh"
)
_NATIONALITY = re.compile(rf"^(?P<facet>{_DEMONYMS}) (?P<head>[a-z].+)$")
_PREPOSITION = re.compile(r"^(?P<head>[A-Z][^,]*?) (?P<prep>of|in) (?P<facet>.+)$")
_LAST_WORD = re.compile(r"^(?P<facet>.+) (?P<head>[a-z][\w-]+)$")
_FUNCTION_WORDS = frozenset("a an and by for from in of on or the to with".split())


def normalize_description(description: str) -> str:
    """The description without parentheses, years, ordinals and trailing connectives."""
    text = re.sub(r"\s*\([^)]*\)", "", description)
    text = re.sub(r"\b\d+(?:st|nd|rd|th)[- ]century\b", "", text)
    text = re.sub(r"\b(?:from|since|until|between|to|and|in|c\.|ca\.)?\s*\d{1,4}s?\b(?: BC| BCE| AD| CE)?", "", text)
    text = re.sub(r"\b\d+(?:st|nd|rd|th)\b", "", text)
    text = re.sub(r"\s+", " ", text).strip(" ,;:–-")
    # connectives the removed years leave behind: "Empire in West Africa from to"
    return re.sub(r"(?:[\s,;:–-]+(?:from|to|since|until|between|and|c\.|ca\.|BC|BCE|AD|CE)\b)+$", "", text).strip(" ,;:–-")


def _or_list(items: list[str]) -> str:
    sep = "; " if any("," in item for item in items) else ", "  # "Maharashtra, India; Egypt"
    return items[0] if len(items) == 1 else sep.join(items[:-1]) + " or " + items[-1]


@dataclass(frozen=True)
class SubGroup:
    """Articles sharing one normalised description (one search's worth of answers)."""

    description: str
    titles: tuple[str, ...]


@dataclass(frozen=True)
class MultiSearchQuestion:
    """A union question before it becomes a unified row; ``queries``: one search per sub-group."""

    key: str  # the head the split is drawn from
    question: str
    subgroups: tuple[SubGroup, ...]
    queries: tuple[str, ...]
    split: str = ""

    @property
    def titles(self) -> list[str]:
        return sorted({t for group in self.subgroups for t in group.titles})


@dataclass(frozen=True)
class _Facet:
    kind: str  # nationality | of | in | word
    head: str
    facet: str


def facet_of(description: str, max_facet_words: int = 4) -> _Facet | None:
    """Split a normalised description into (head, facet): the first rule that matches.

    Facets longer than ``max_facet_words`` words (clauses rather than names) give None.
    """
    facet = _split_facet(description)
    if facet is None or len(facet.facet.split()) > max_facet_words or re.search(r"[;'\"]", facet.facet):
        return None
    return facet


def _split_facet(description: str) -> _Facet | None:
    match = _NATIONALITY.match(description)
    if match:
        return _Facet("nationality", match["head"], match["facet"])
    match = _PREPOSITION.match(description)
    # a comma in a place ("Maharashtra, India") is a name; elsewhere it starts a clause
    if match and match["facet"].split()[0].lower() not in _FUNCTION_WORDS - {"the"} and (
        match["prep"] == "in" or "," not in match["facet"]
    ):
        return _Facet(match["prep"], match["head"], match["facet"])
    match = _LAST_WORD.match(description)
    words = match["facet"].split() if match else []
    if match and "," not in match["facet"] and len(words) <= 2 and not {words[0], words[-1]} & _FUNCTION_WORDS:
        return _Facet("word", match["head"], match["facet"])
    return None


def _sentence_case(phrase: str, case: Mapping[str, bool], *, head: bool) -> str:
    """Lower the first letter of a description's first word: a head's unless it is a nationality
    ("Greek goddess"); a facet's when the articles write that word lower-case mid-sentence more
    often than not ("music", not "Catalan"); neither in a name of several capitalised words
    ("Prime Minister", "West Germanic")."""
    words = phrase.split(" ")
    if any(w[:1].isupper() for w in words[1:]):  # "Prime Minister", "West Germanic"
        return phrase
    lowered = not _NATIONALITY.match(phrase) if head else case.get(words[0].lower(), False)
    return phrase[:1].lower() + phrase[1:] if lowered else phrase


def union_question(kind: str, head: str, facets: list[str], case: Mapping[str, bool]) -> str:
    """The question for the union of ``head`` over ``facets``; ``case``: word → written lower-case
    (see :func:`word_case`)."""
    names = pluralize(_sentence_case(head, case, head=True))
    if kind == "nationality":
        return f"Which {_or_list(facets)} {names} are there?"
    if kind == "in":
        return f"Which {names} are in {_or_list(facets)}?"
    if kind == "of":
        return f"Which {names} of {_or_list(facets)} are there?"
    return f"Which {_or_list([_sentence_case(f, case, head=False) for f in facets])} {names} are there?"


_TOKEN = re.compile(r"[^\W\d_][\w-]*|[.!?]")


def word_case(texts: list[str]) -> dict[str, bool]:
    """Word (lower-cased) → whether ``texts`` write it lower-case more often than capitalised,
    counting only words inside a sentence (not after ``.``, ``!``, ``?`` or at the start)."""
    lower: dict[str, int] = defaultdict(int)
    upper: dict[str, int] = defaultdict(int)
    for text in texts:
        sentence_start = True
        for token in _TOKEN.findall(text):
            if token in ".!?":
                sentence_start = True
                continue
            if not sentence_start:
                (lower if token[:1].islower() else upper)[token.lower()] += 1
            sentence_start = False
    return {word: lower[word] > upper[word] for word in set(lower) | set(upper)}


def element_questions(articles: pd.DataFrame, window: int, per_search: int) -> list[MultiSearchQuestion]:
    """Atomic-number windows ``[1, window], [window+1, 2·window], …``; one search per ``per_search`` numbers."""
    numbers: dict[int, str] = {}
    for title, description in zip(articles["title"], articles["description"], strict=True):
        match = ELEMENT.match(description)
        if match:
            numbers[int(match["number"])] = title
    out = []
    for start in range(1, max(numbers, default=0) + 1, window):
        span = range(start, start + window)
        present = [n for n in span if n in numbers]
        if len(present) < 2:
            continue
        chunks = [present[i : i + per_search] for i in range(0, len(present), per_search)]
        out.append(
            MultiSearchQuestion(
                key=f"element-{start}",
                question=f"Which chemical elements have atomic numbers from {span[0]} to {span[-1]}?",
                subgroups=tuple(
                    SubGroup(f"Chemical element with atomic number {' '.join(map(str, c))}", tuple(numbers[n] for n in c))
                    for c in chunks
                ),
                queries=tuple(f"Chemical element with atomic number {' '.join(map(str, c))}" for c in chunks),
            )
        )
    return out


_MAX_COMBINATIONS = 20_000


def _combinations(n: int, max_size: int, seed: str) -> list[tuple[int, ...]]:
    """Index sets of 2..``max_size`` of ``n`` members: all of them, or, where there are more than
    ``_MAX_COMBINATIONS`` (a head with ~40 facets has 10^5), that many drawn with a seeded generator."""
    sizes = range(2, min(max_size, n) + 1)
    if sum(math.comb(n, k) for k in sizes) <= _MAX_COMBINATIONS:
        return [c for k in sizes for c in itertools.combinations(range(n), k)]
    rng = np.random.default_rng(int(hashlib.sha1(seed.encode()).hexdigest()[:12], 16))
    drawn: set[tuple[int, ...]] = set()
    for k in sizes:  # the same number of draws per size; a draw is the first k of a random permutation
        picks = np.sort(np.argsort(rng.random((_MAX_COMBINATIONS // len(sizes), n)), axis=1)[:, :k], axis=1)
        drawn.update(map(tuple, picks.tolist()))
    return sorted(drawn)


def union_questions(articles: pd.DataFrame, params: Mapping[str, Any]) -> list[MultiSearchQuestion]:
    """Union questions over description heads (without splits; see :func:`build_questions`)."""
    salt = str(params.get("salt", "spader"))
    max_subgroup = int(params.get("max_subgroup_answers", 6))
    min_subgroup = int(params.get("min_subgroup_answers", 1))
    min_answers = int(params.get("min_answers", 5))
    max_subgroups = int(params.get("max_subgroups", 4))
    max_share = float(params.get("max_share", 0.5))
    max_uses = int(params.get("max_uses_per_subgroup", 2))
    max_facet_words = int(params.get("max_facet_words", 4))

    described = articles[articles["description"].str.len() > 0]
    normalized = described["description"].map(normalize_description)
    groups: dict[str, list[str]] = defaultdict(list)
    for title, description in zip(described["title"], normalized, strict=True):
        if description and not ELEMENT.match(description):
            groups[description].append(title)
    case = word_case([*described["description"], *described.get("extract", [])])

    heads: dict[tuple[str, str], list[tuple[str, SubGroup]]] = defaultdict(list)
    for description in sorted(groups):
        titles = tuple(sorted(groups[description]))
        facet = facet_of(description, max_facet_words)
        if facet is None or not min_subgroup <= len(titles) <= max_subgroup:
            continue
        heads[(facet.kind, facet.head)].append((facet.facet, SubGroup(description, titles)))

    out = []
    for (kind, head), members in sorted(heads.items()):
        if len(members) < 2:
            continue
        candidates = []
        for combo in _combinations(len(members), max_subgroups, f"{salt}|{kind}|{head}"):
            sizes = [len(members[i][1].titles) for i in combo]
            total = sum(sizes)
            if total >= min_answers and max(sizes) <= max_share * total:
                candidates.append(tuple(members[i] for i in combo))
        # a salted order, then each sub-group in at most ``max_uses`` questions
        candidates.sort(key=lambda c: _stable_fraction("|".join(g.description for _, g in c), salt))
        uses: dict[str, int] = defaultdict(int)
        for combo in candidates:
            if any(uses[g.description] >= max_uses for _, g in combo):
                continue
            for _, group in combo:
                uses[group.description] += 1
            facets = [name for name, _ in combo]
            out.append(
                MultiSearchQuestion(
                    key=f"{kind}|{head}",
                    question=union_question(kind, head, facets, case),
                    subgroups=tuple(group for _, group in combo),
                    queries=tuple(group.description for _, group in combo),
                )
            )
    return out


def build_questions(articles: pd.DataFrame, params: Mapping[str, Any]) -> list[MultiSearchQuestion]:
    """All multi-search questions with their splits (drawn per head key), in a deterministic order."""
    salt = str(params.get("salt", "spader"))
    questions = union_questions(articles, params)
    if params.get("element_window"):
        questions += element_questions(articles, int(params["element_window"]), int(params.get("element_per_search", 3)))
    seen: set[tuple[str, ...]] = set()
    out = []
    for q in questions:
        answer_set = tuple(q.titles)
        if answer_set in seen:  # two heads can give the same union; keep the first
            continue
        seen.add(answer_set)
        split = assign_split(q.key, params["splits"], salt)
        out.append(MultiSearchQuestion(q.key, q.question, q.subgroups, q.queries, split))
    return out


def build_multi_search_qa(articles: pd.DataFrame, params: Mapping[str, Any]) -> list[QARow]:
    """Unified rows of the multi-search questions (``embedded_qa.mode: multi_search``)."""
    questions = build_questions(articles, params)
    logger.info("multi-search QA: %d questions", len(questions))
    return question_rows(questions)


def question_rows(questions: list[MultiSearchQuestion]) -> list[QARow]:
    """Unified rows (``ground_truth``: each title with its bare form) of built questions."""
    return [
        {
            "id": make_id(DATA_SOURCE, f"multi-{_short_hash(q.question + '|' + '|'.join(q.titles))}"),
            "question": q.question,
            "ground_truth": [title_aliases(title) for title in q.titles],
            "data_source": DATA_SOURCE,
            "split": q.split,
        }
        for q in questions
    ]
