"""Answer normalisation and alias-aware entity matching, shared by training rewards and evaluation.

One notion of correctness for the whole project (reference defect 2): a ground-truth entity is a list
of surface forms (aliases); it counts as *predicted* when any normalised prediction equals any of
its normalised aliases, and as *found in a document* when any normalised alias occurs in the
normalised document text as a whole-word sequence (reference defect 3: "entity b" never matches
"entity beatles").

Normalisation follows SPADER's evaluation code (spec §3.1, the SQuAD recipe plus quote/dash
folding). Document matching runs one Aho-Corasick automaton over all texts at once, so its cost is
linear in the text length and independent of the number of aliases.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import ahocorasick
import numpy as np

__all__ = [
    "AnswerScore",
    "EntityMatcher",
    "GroundTruth",
    "find_entities_batched",
    "ground_truth_key",
    "normalize_answer",
    "normalize_ground_truth",
    "normalize_ground_truths",
    "score_answers",
]

# --------------------------------------------------------------------------------------------
# Normalisation (spec §3.1)
# --------------------------------------------------------------------------------------------

_QUOTE_FOLD = {"\u2019": "'", "\u2018": "'", "\u201d": '"', "\u201c": '"'}
_DELETED = set(string.punctuation) | {"\u2014", "\u2013", "\u2010"}  # + em dash, en dash, hyphen
# Quote folding happens before punctuation deletion and only produces punctuation, so a single
# translate table that deletes both the folded quotes and the punctuation is equivalent.
# ASCII whitespace becomes a plain space (regex \b and str.split treat them alike).
_TRANSLATE = str.maketrans(
    {**{ch: None for ch in _DELETED | set(_QUOTE_FOLD)}, **dict.fromkeys("\t\n\r\x0b\x0c", " ")}
)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
# Text made only of [a-z0-9 ] has word boundaries exactly at spaces: articles are whole tokens there.
_NOT_SIMPLE = re.compile(r"[^a-z0-9 ]")
# Segment separator for batched matching: survives normalisation (not punctuation, not whitespace,
# not a word character) and can never be part of a normalised alias.
_SEP = "\x00"


def normalize_answer(text: object) -> str:
    """Normalise an answer or document string (spec §3.1).

    ``None`` → ``""``; other non-strings → ``str(x)``; lowercase; fold curly quotes and the two-character
    quote forms; delete ASCII punctuation plus em dash, en dash and hyphen; replace the whole words
    *a*, *an*, *the* with a space; collapse whitespace. Unicode letters are kept.

    >>> normalize_answer("The Beatles"), normalize_answer("A-ha"), normalize_answer("U.S.A.")
    ('beatles', 'aha', 'usa')
    >>> normalize_answer("C++"), normalize_answer("Entity A"), normalize_answer(None)
    ('c', 'entity', '')
    """
    if text is None:
        return ""
    s = text if isinstance(text, str) else str(text)
    s = s.lower().translate(_TRANSLATE)
    if _NOT_SIMPLE.search(s) is None:
        # Fast path, same result as the regex below: drop whole-token articles, collapse spaces.
        s = f" {s} "
        while "  " in s:
            s = s.replace("  ", " ")
        for article in (" a ", " an ", " the "):
            while article in s:
                s = s.replace(article, " ")
        return s.strip()
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _normalize_no_sep(text: object) -> str:
    s = normalize_answer(text)
    return " ".join(s.replace(_SEP, " ").split()) if _SEP in s else s


# --------------------------------------------------------------------------------------------
# Ground truth
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroundTruth:
    """Normalised ground truth: one alias set per entity.

    Attributes:
        aliases: per entity, the tuple of distinct non-empty normalised aliases (input order kept).
        canonical: per entity, its first non-empty raw alias (for reporting).
    Entities with no non-empty alias are dropped and entities with identical alias sets are merged,
    as in the reference evaluation (spec §6.4).
    """

    aliases: tuple[tuple[str, ...], ...]
    canonical: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.aliases)

    @cached_property
    def alias_to_entities(self) -> dict[str, tuple[int, ...]]:
        """Normalised alias → indices of the entities that own it (an alias may be shared)."""
        out: dict[str, list[int]] = {}
        for idx, names in enumerate(self.aliases):
            for name in names:
                out.setdefault(name, []).append(idx)
        return {k: tuple(v) for k, v in out.items()}


def _as_alias_list(entity: object) -> list[object]:
    # A bare string is one entity with one alias (flat ground-truth lists), never a char sequence.
    if isinstance(entity, (str, bytes)) or not isinstance(entity, Iterable):
        return [entity]
    return list(entity)


def ground_truth_key(ground_truth: object) -> object:
    """A hashable key equal for equal raw ground truths (rollouts of one prompt share it)."""
    if isinstance(ground_truth, GroundTruth):
        return ground_truth.aliases
    if ground_truth is None or isinstance(ground_truth, (str, bytes)):
        return ("raw", ground_truth)
    return tuple(
        tuple(a if isinstance(a, str) else (type(a).__name__, repr(a)) for a in _as_alias_list(e))
        for e in ground_truth
    )


def normalize_ground_truths(ground_truths: Sequence[object]) -> list[GroundTruth]:
    """:func:`normalize_ground_truth` for a batch, normalising each distinct ground truth once."""
    cache: dict[object, GroundTruth] = {}
    out = []
    for gt in ground_truths:
        key = ground_truth_key(gt)
        if key not in cache:
            cache[key] = normalize_ground_truth(gt)
        out.append(cache[key])
    return out


def normalize_ground_truth(ground_truth: Sequence[Sequence[str]] | GroundTruth | None) -> GroundTruth:
    """Turn ``[[alias, ...], ...]`` (or a flat ``[name, ...]``) into a :class:`GroundTruth`."""
    if isinstance(ground_truth, GroundTruth):
        return ground_truth
    if ground_truth is None or isinstance(ground_truth, (str, bytes)):
        ground_truth = [] if ground_truth is None else [ground_truth]
    aliases: list[tuple[str, ...]] = []
    canonical: list[str] = []
    seen: set[frozenset[str]] = set()
    for entity in ground_truth:
        raw = _as_alias_list(entity)
        names = tuple(dict.fromkeys(n for n in (_normalize_no_sep(x) for x in raw) if n))
        if not names or frozenset(names) in seen:
            continue
        seen.add(frozenset(names))
        aliases.append(names)
        canonical.append(next(str(x) for x in raw if normalize_answer(x)))
    return GroundTruth(tuple(aliases), tuple(canonical))


# --------------------------------------------------------------------------------------------
# Final-answer scoring
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerScore:
    """Alias-aware set scores of one predicted answer list against one ground truth.

    Precision definitions (``precision_mode`` of :func:`score_answers`):
      * ``"prediction"`` (default, = reference evaluation, spec §6.4): a distinct normalised prediction is
        correct when it equals any alias of any entity; precision = correct predictions / distinct
        predictions. Two aliases of the same entity both count as correct.
      * ``"entity"``: each correct prediction is credited to at most one entity and each entity at most
        once (a maximum matching); precision = credited / (credited + wrong predictions). Listing several
        aliases of one entity earns one credit, so precision cannot be inflated that way.
    Recall is always matched entities / entities; F1 is their harmonic mean (0 when both are 0);
    exact match is ``f1 == 1``.
    """

    precision: float
    recall: float
    f1: float
    exact_match: float
    num_predicted: int
    num_correct: int
    num_gt: int
    matched: tuple[int, ...] = field(default=())

    def recall_at(self, k: int) -> float:
        """``min(|matched| / min(k, num_gt), 1)``; 0 when there is no ground truth."""
        if self.num_gt == 0 or k <= 0:
            return 0.0
        return min(len(self.matched) / min(k, self.num_gt), 1.0)


def _max_matching(hits: Sequence[Sequence[int]]) -> int:
    """Size of a maximum matching between correct predictions and the entities they hit (Kuhn)."""
    owner: dict[int, int] = {}

    def augment(p: int, visited: set[int]) -> bool:
        for e in hits[p]:
            if e not in visited:
                visited.add(e)
                if e not in owner or augment(owner[e], visited):
                    owner[e] = p
                    return True
        return False

    return sum(augment(p, set()) for p in range(len(hits)))


def score_answers(
    predicted: Sequence[str] | None,
    ground_truth: Sequence[Sequence[str]] | GroundTruth,
    *,
    precision_mode: str = "prediction",
) -> AnswerScore:
    """Score predicted entity names against alias lists (see :class:`AnswerScore` for definitions).

    Args:
        predicted: raw predicted strings; normalised, empties dropped, deduplicated. ``None`` is treated
            as no prediction (callers decide separately whether that is a format error).
        ground_truth: ``[[alias, ...], ...]`` per entity, or a pre-normalised :class:`GroundTruth`.
        precision_mode: ``"prediction"`` (reference-compatible) or ``"entity"``.

    >>> s = score_answers(["Entity A", "Alias A", "Beatles", "Foo"],
    ...                   [["Entity A", "Alias A"], ["Entity B"], ["The Beatles", "Beatles"]])
    >>> round(s.precision, 3), round(s.recall, 3), round(s.f1, 3), s.matched
    (0.75, 0.667, 0.706, (0, 2))
    """
    if precision_mode not in ("prediction", "entity"):
        raise ValueError(f"precision_mode must be 'prediction' or 'entity', got {precision_mode!r}")
    gt = normalize_ground_truth(ground_truth)
    preds = list(dict.fromkeys(p for p in (normalize_answer(x) for x in (predicted or ())) if p))
    lookup = gt.alias_to_entities
    hits = [lookup[p] for p in preds if p in lookup]
    correct = len(hits)
    matched = tuple(sorted({e for h in hits for e in h}))
    num_pred, num_gt = len(preds), len(gt)
    if num_pred == 0 or num_gt == 0:
        return AnswerScore(0.0, 0.0, 0.0, 0.0, num_pred, correct, num_gt, matched)
    if precision_mode == "prediction":
        precision = correct / num_pred
    else:
        credited = _max_matching(hits)
        precision = credited / (credited + num_pred - correct)
    recall = len(matched) / num_gt
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return AnswerScore(precision, recall, f1, float(f1 == 1.0), num_pred, correct, num_gt, matched)


# --------------------------------------------------------------------------------------------
# Entity discovery in documents
# --------------------------------------------------------------------------------------------


def _join_normalised(texts: Sequence[str]) -> tuple[str, np.ndarray]:
    """Normalise texts and join them into one string ``" t0 \\0 t1 \\0 ... "``.

    Returns the string and the start offset of every segment (shape ``[len(texts)]``). Each
    normalised word is surrounded by single spaces, so ``" alias "`` only matches whole words, and no
    pattern can cross a separator.
    """
    norm = [_normalize_no_sep(t) for t in texts]
    lengths = np.fromiter((len(s) for s in norm), dtype=np.int64, count=len(norm))
    # segment i occupies [start_i, start_i + len_i); separators are " \0 " (3 chars), a leading " ".
    starts = np.empty(len(norm), dtype=np.int64)
    if len(norm):
        starts[0] = 1
        np.cumsum(lengths[:-1] + 3, out=starts[1:])
        starts[1:] += 1
    return " " + f" {_SEP} ".join(norm) + " ", starts


class EntityMatcher:
    """Find which ground-truth entities occur in documents (alias-aware, whole words, normalised).

    Args:
        ground_truth: ``[[alias, ...], ...]`` per entity (or a :class:`GroundTruth`).

    ``found_in(texts)`` returns a bool array of shape ``[len(texts), num_entities]``. All texts are
    normalised, joined with separators and scanned in a single Aho-Corasick pass.

    >>> m = EntityMatcher([["Entity B"], ["The Beatles", "Beatles"]])
    >>> m.found_in(["Entity Beatles formed in Liverpool", "entity B, then the BEATLES", "entity-b"]).tolist()
    [[False, True], [True, True], [False, False]]
    """

    def __init__(self, ground_truth: Sequence[Sequence[str]] | GroundTruth) -> None:
        self.ground_truth = normalize_ground_truth(ground_truth)
        self._automaton: ahocorasick.Automaton | None = None
        lookup = self.ground_truth.alias_to_entities
        if lookup:
            automaton = ahocorasick.Automaton()
            for alias, entities in lookup.items():
                automaton.add_word(f" {alias} ", np.asarray(entities, dtype=np.int64))
            automaton.make_automaton()
            self._automaton = automaton

    @property
    def num_entities(self) -> int:
        return len(self.ground_truth)

    def found_in(self, texts: Sequence[str]) -> np.ndarray:
        """Bool ``[len(texts), num_entities]``: entity ``e`` has an alias in text ``i``."""
        found = np.zeros((len(texts), self.num_entities), dtype=bool)
        if self._automaton is None or not texts:
            return found
        joined, starts = _join_normalised(texts)
        ends: list[int] = []
        ents: list[np.ndarray] = []
        for end, entities in self._automaton.iter(joined):
            ends.append(end)
            ents.append(entities)
        if ends:
            seg = np.searchsorted(starts, np.asarray(ends, dtype=np.int64), side="right") - 1
            counts = np.fromiter((len(e) for e in ents), dtype=np.int64, count=len(ents))
            found[np.repeat(seg, counts), np.concatenate(ents)] = True
        return found

    def count_in(self, texts: Sequence[str]) -> np.ndarray:
        """Int ``[len(texts)]``: number of distinct entities found in each text."""
        return self.found_in(texts).sum(axis=1)


def find_entities_batched(
    ground_truths: Sequence[Sequence[Sequence[str]] | GroundTruth],
    texts: Sequence[Sequence[str]],
) -> list[np.ndarray]:
    """Batched :meth:`EntityMatcher.found_in` for many ``(ground_truth, texts)`` pairs.

    Items with the same ground truth (e.g. the rollouts of one prompt group) share one automaton.
    Returns, per item ``k``, a bool array ``[len(texts[k]), num_entities_k]``.
    """
    if len(ground_truths) != len(texts):
        raise ValueError(f"got {len(ground_truths)} ground truths but {len(texts)} text lists")
    matchers: dict[object, EntityMatcher] = {}
    groups: dict[object, list[int]] = {}
    for k, gt in enumerate(ground_truths):
        key = ground_truth_key(gt)
        if key not in matchers:
            matchers[key] = EntityMatcher(gt)
        groups.setdefault(key, []).append(k)
    out: list[np.ndarray] = [np.zeros((0, 0), dtype=bool)] * len(texts)
    for key, items in groups.items():
        flat = [t for k in items for t in texts[k]]
        found = matchers[key].found_in(flat)
        offset = 0
        for k in items:
            n = len(texts[k])
            out[k] = found[offset : offset + n]
            offset += n
    return out
