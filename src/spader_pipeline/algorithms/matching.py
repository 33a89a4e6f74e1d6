"""Answer normalisation and alias-aware entity matching, shared by training rewards and evaluation.

One notion of correctness for the whole project (reference defect 2): a ground-truth entity is a list
of surface forms (aliases); it counts as *predicted* when any normalised prediction equals any of
its normalised aliases, and as *found in a document* when any normalised alias occurs in the
normalised document text as a whole-word sequence (reference defect 3: "entity b" never matches
"entity beatles").

Normalisation follows SPADER's evaluation code (KhanCold/spader: the SQuAD recipe plus quote/dash
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
    "find_entities_in_steps",
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


# --------------------------------------------------------------------------------------------
# Entity discovery in documents
# --------------------------------------------------------------------------------------------


def _join_segments(normalised: Sequence[str]) -> tuple[str, np.ndarray]:
    """Join normalised texts into one string ``" t0 \\0 t1 \\0 ... "``.

    Returns the string and the start offset of every segment (shape ``[len(texts)]``). Each
    normalised word is surrounded by single spaces, so ``" alias "`` only matches whole words, and no
    pattern can cross a separator.
    """
    lengths = np.fromiter((len(s) for s in normalised), dtype=np.int64, count=len(normalised))
    # segment i occupies [start_i, start_i + len_i); separators are " \0 " (3 chars), a leading " ".
    starts = np.empty(len(normalised), dtype=np.int64)
    if len(normalised):
        starts[0] = 1
        np.cumsum(lengths[:-1] + 3, out=starts[1:])
        starts[1:] += 1
    return " " + _JOIN.join(normalised) + " ", starts


class EntityMatcher:
    """Find which ground-truth entities occur in documents (alias-aware, whole words, normalised).

    Args:
        ground_truth: ``[[alias, ...], ...]`` per entity (or a :class:`GroundTruth`).

    ``found_in(texts)`` returns a bool array of shape ``[len(texts), num_entities]``. All texts are
    normalised together (:func:`normalize_texts`), joined with separators and scanned in a single
    Aho-Corasick pass.

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
        return self.found_in_normalised(normalize_texts(texts) if self._automaton is not None else texts)

    def found_in_normalised(self, normalised: Sequence[str]) -> np.ndarray:
        """:meth:`found_in` for texts already passed through :func:`normalize_texts`."""
        found = np.zeros((len(normalised), self.num_entities), dtype=bool)
        if self._automaton is None or not normalised:
            return found
        joined, starts = _join_segments(normalised)
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

    Returns, per item ``k``, a bool array ``[len(texts[k]), num_entities_k]`` (see
    :func:`find_entities_in_steps`, which this wraps: every distinct text is normalised once per
    batch and scanned once per distinct ground truth).
    """
    if len(ground_truths) != len(texts):
        raise ValueError(f"got {len(ground_truths)} ground truths but {len(texts)} text lists")
    gts = normalize_ground_truths(ground_truths)
    width = max((len(t) for t in texts), default=0)
    found = find_entities_in_steps(gts, texts, width)
    return [found[k, : len(texts[k]), : len(gt)] for k, gt in enumerate(gts)]


def find_entities_in_steps(
    ground_truths: Sequence[GroundTruth],
    step_documents: Sequence[Sequence[str | Sequence[str]]],
    width: int,
) -> np.ndarray:
    """Which entities each step's documents contain, for a whole batch: bool ``[B, width, E]``.

    Args:
        ground_truths: ``[B]`` normalised ground truths (trajectories of one prompt share theirs).
        step_documents: per trajectory, per step, the step's documents: a list of document texts, or
            one string (one document). Steps beyond ``width`` are ignored.
        width: ``S``, the step axis of the result.
    Returns ``found[i, t, e]``: an alias of entity ``e`` of ``ground_truths[i]`` occurs as whole words
    in a document of step ``t``; ``E`` = most entities of any trajectory (padding is False).

    A document is usually retrieved by many trajectories of a batch (rollouts of one prompt issue
    similar queries), so every distinct document text is normalised exactly once for the whole batch
    (:func:`normalize_texts`, one pass over their concatenation) and scanned once per distinct ground
    truth (one Aho-Corasick pass over that group's distinct documents); a step's entities are then
    the OR of its documents' rows, gathered with array operations.
    """
    bsz = len(ground_truths)
    n_ent = max((len(g) for g in ground_truths), default=0)
    found = np.zeros((bsz, width, n_ent), dtype=bool)
    if not bsz or not width or not n_ent:
        return found
    # Flatten to (trajectory-step row, distinct document id) pairs; rows are i * width + t.
    doc_ids: dict[str, int] = {}
    pair_rows: list[int] = []
    pair_docs: list[int] = []
    for i, steps in enumerate(step_documents):
        if not len(ground_truths[i]):
            continue
        for t, docs in enumerate(steps[:width]):
            if isinstance(docs, str):
                docs = (docs,)
            row = i * width + t
            for doc in docs:
                pair_rows.append(row)
                pair_docs.append(doc_ids.setdefault(doc, len(doc_ids)))
    if not pair_rows:
        return found
    normalised = normalize_texts(list(doc_ids))
    rows = np.asarray(pair_rows, dtype=np.int64)
    docs_arr = np.asarray(pair_docs, dtype=np.int64)
    # Group trajectories by ground truth: one automaton and one scan per group.
    groups: list[GroundTruth] = []
    key_to_group: dict[object, int] = {}
    traj_group = np.empty(bsz, dtype=np.int64)
    for i, gt in enumerate(ground_truths):
        g = key_to_group.setdefault(gt.aliases, len(groups))
        if g == len(groups):
            groups.append(gt)
        traj_group[i] = g
    pair_group = traj_group[rows // width]
    order = np.argsort(pair_group, kind="stable")  # keeps rows ascending within a group
    bounds = np.searchsorted(pair_group[order], np.arange(len(groups) + 1))
    flat = found.reshape(bsz * width, n_ent)
    for g, gt in enumerate(groups):
        sel = order[bounds[g] : bounds[g + 1]]
        if not sel.size:
            continue
        g_rows, g_docs = rows[sel], docs_arr[sel]
        uniq, local = np.unique(g_docs, return_inverse=True)
        doc_found = EntityMatcher(gt).found_in_normalised([normalised[u] for u in uniq])  # [U_g, E_g]
        if not doc_found.any():
            continue
        hit = doc_found[local]  # [P_g, E_g], one row per (step, document) pair
        step_rows, first = np.unique(g_rows, return_index=True)
        flat[step_rows, : len(gt)] = np.logical_or.reduceat(hit, first, axis=0)
    return found
