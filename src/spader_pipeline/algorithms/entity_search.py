"""Which gold entities occur in which documents: whole-word, alias-aware, one scan for a whole batch.

An entity is *found in a document* when any of its normalised aliases occurs in the normalised
document text as a whole-word sequence ("entity b" never matches "entity beatles"); discovery credit
comes from retrieved documents only, never from the agent's own query text (docs/algorithms.md).
One Aho-Corasick automaton runs over all texts at once, so the cost is linear in the text length and
independent of the number of aliases.
"""

from __future__ import annotations

from collections.abc import Sequence

import ahocorasick
import numpy as np

from .matching import _JOIN, GroundTruth, normalize_ground_truth, normalize_ground_truths, normalize_texts

__all__ = ["EntityMatcher", "find_entities_batched", "find_entities_in_steps"]


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
