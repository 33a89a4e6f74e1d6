"""Answer normalisation and alias-aware answer scoring, shared by training rewards and evaluation.

One notion of correctness for the whole project: a ground-truth entity is a list of surface forms
(aliases); it counts as *predicted* when any normalised prediction equals any of its normalised
aliases (one alias per entity, matched one-to-one). Finding entities in retrieved documents is
:mod:`.entity_search`, on the same normalisation.

Normalisation follows SPADER's evaluation code (KhanCold/spader: the SQuAD recipe plus quote/dash
folding), see docs/metrics.md.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

__all__ = [
    "AnswerScore",
    "GroundTruth",
    "ground_truth_key",
    "normalize_answer",
    "normalize_ground_truth",
    "normalize_ground_truths",
    "normalize_texts",
    "score_answers",
]

# --------------------------------------------------------------------------------------------
# Normalisation (SPADER's evaluation code; docs/metrics.md)
# --------------------------------------------------------------------------------------------

_QUOTE_FOLD = {"\u2019": "'", "\u2018": "'", "\u201d": '"', "\u201c": '"'}
_DELETED = set(string.punctuation) | {"\u2014", "\u2013", "\u2010"}  # + em dash, en dash, hyphen
#: Every character ``str.split()`` treats as whitespace (``str.isspace``; a test enumerates them).
WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + (
    "\u2028\u2029\u202f\u205f\u3000"
)
# One translate table does the per-character work: quote folding happens before punctuation deletion
# and only produces punctuation, so deleting the folded quotes directly is equivalent; every
# whitespace character becomes a plain space (to the article regex both are non-word characters,
# and the final whitespace collapse then only has to squeeze runs of spaces).
_TRANSLATE = str.maketrans({**{ch: None for ch in _DELETED | set(_QUOTE_FOLD)}, **dict.fromkeys(WHITESPACE, " ")})
# Same matches as r"\b(a|an|the)\b" (an article is a whole run of word characters), written so that
# every branch starts with a literal: the regex engine then skips to candidate 'a'/'t' characters
# instead of trying a word boundary at every position (~6x faster on long documents).
_ARTICLES = re.compile(r"t(?<!\w.)he\b|a(?<!\w.)n?\b")
_SPACE_RUNS = re.compile("  +")  # a two-space literal prefix: found by fast search, unlike " {2,}"
# Segment separator for batched normalisation and matching: survives normalisation (not punctuation,
# not whitespace, not a word character, not cased) and can never be part of a normalised alias.
_SEP = "\x00"
_JOIN = f" {_SEP} "


def normalize_answer(text: object) -> str:
    """Normalise an answer or document string (SPADER's evaluation recipe, docs/metrics.md).

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
    s = _ARTICLES.sub(" ", s.lower().translate(_TRANSLATE))
    return _SPACE_RUNS.sub(" ", s).strip(" ")


def normalize_texts(texts: Sequence[object]) -> list[str]:
    """``normalize_answer`` of many documents in four passes over their concatenation.

    The texts are joined with ``" \\0 "``, lowercased, translated, stripped of articles and
    whitespace-collapsed as one string, then split again: each step is a per-character map or a
    regex whose matches cannot cross the separator (a space, which also ends the lowercase final-sigma
    context), so the result equals ``normalize_answer`` of each text — except that a NUL character
    inside a text becomes a space (NUL is the separator; for whole-word matching the two are
    equivalent). Cost: a few C-level passes over the characters, no per-word Python work.
    """
    if not texts:
        return []
    parts = [t if isinstance(t, str) else ("" if t is None else str(t)) for t in texts]
    joined = _JOIN.join(parts)
    if joined.count(_SEP) != len(parts) - 1:  # a text contains the separator itself (rare)
        joined = _JOIN.join(t.replace(_SEP, " ") for t in parts)
    s = _ARTICLES.sub(" ", joined.lower().translate(_TRANSLATE))
    return [part.strip(" ") for part in _SPACE_RUNS.sub(" ", s).split(_SEP)]


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
    as in the reference evaluation (docs/metrics.md).
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
    # The same object (rollouts of one prompt often share it) needs no key; the entry holds the object
    # so that its id cannot be reused by another one while the loop runs.
    by_id: dict[int, tuple[object, GroundTruth]] = {}
    out = []
    for gt in ground_truths:
        seen = by_id.get(id(gt))
        if seen is None:
            key = ground_truth_key(gt)
            if key not in cache:
                cache[key] = normalize_ground_truth(gt)
            seen = by_id[id(gt)] = (gt, cache[key])
        out.append(seen[1])
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
      * ``"prediction"`` (default, = reference evaluation, docs/metrics.md): a distinct normalised prediction is
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
