"""Straightforward per-token / per-entity Python loops of the reference formulas (SPADER, arXiv 2606.00593).

Independent of the vectorised code under test: used by the equivalence tests and the benchmark.
Kept deliberately literal (one ``.item()`` per token, one substring test per entity and step).
"""

from __future__ import annotations

import math
import re
import string

import torch

from spader_pipeline.algorithms.matching import normalize_answer, normalize_ground_truth

# The project's normaliser as it was before the batched rewrite (issue 12), kept verbatim so that the
# new one can be property-tested against it.
_PREV_TRANSLATE = str.maketrans(
    {
        **{
            ch: None
            for ch in set(string.punctuation)
            | {"\u2014", "\u2013", "\u2010", "\u2019", "\u2018", "\u201d", "\u201c"}
        },
        **dict.fromkeys("\t\n\r\x0b\x0c", " "),
    }
)
_PREV_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PREV_NOT_SIMPLE = re.compile(r"[^a-z0-9 ]")


def normalize_answer_previous(text: object) -> str:
    """``matching.normalize_answer`` before issue 12 (translate + fast path + regex path)."""
    if text is None:
        return ""
    s = text if isinstance(text, str) else str(text)
    s = s.lower().translate(_PREV_TRANSLATE)
    if _PREV_NOT_SIMPLE.search(s) is None:
        s = f" {s} "
        while "  " in s:
            s = s.replace("  ", " ")
        for article in (" a ", " an ", " the "):
            while article in s:
                s = s.replace(article, " ")
        return s.strip()
    s = _PREV_ARTICLES.sub(" ", s)
    return " ".join(s.split())


def loop_steps(response_mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """Spans ``[a, b)`` of maximal runs of 1s, token by token."""
    spans, start = [], None
    n = response_mask_row.shape[0]
    for t in range(n):
        v = int(response_mask_row[t].item())
        if v and start is None:
            start = t
        if not v and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, n))
    return spans


def loop_spa(token_level_rewards, response_mask, index, gamma=1.0, eps=1e-6):
    """Reference SPA: per-token step scan, per-group per-step Python statistics."""
    bsz, length = response_mask.shape
    spans = [loop_steps(response_mask[i]) for i in range(bsz)]
    width = max((len(s) for s in spans), default=0)
    adv = torch.zeros(bsz, length)
    ret = torch.zeros(bsz, length)
    if width == 0:
        return adv, ret
    g = [[0.0] * width for _ in range(bsz)]
    for i in range(bsz):
        run = 0.0
        rs = [float(token_level_rewards[i, b - 1].item()) for _, b in spans[i]]
        for t in range(len(rs) - 1, -1, -1):
            run = rs[t] + gamma * run
            g[i][t] = run
    groups: dict[object, list[int]] = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(i)
    a = [[0.0] * width for _ in range(bsz)]
    for members in groups.values():
        for t in range(width):
            vals = [g[j][t] for j in members]
            mu = sum(vals) / len(vals)
            var = sum((v - mu) ** 2 for v in vals) / len(vals)
            for j in members:
                if t < len(spans[j]):
                    a[j][t] = (g[j][t] - mu) / math.sqrt(var + eps)
    for i in range(bsz):
        for t, (s, e) in enumerate(spans[i]):
            for k in range(s, e):
                adv[i, k] = a[i][t]
                ret[i, k] = g[i][t]
    return adv, ret


def _contains_words(text_norm: str, alias: str) -> bool:
    words, aw = text_norm.split(), alias.split()
    return any(words[j : j + len(aw)] == aw for j in range(len(words) - len(aw) + 1))


def loop_spader_rewards(
    response_mask,
    index,
    ground_truths,
    step_documents,
    query_counts,
    f1,
    format_ok,
    *,
    global_step,
    alpha=1.0,
    beta=4.0,
    lam=1.0,
    cost=0.01,
    free=100,
    ramp=100,
    w_final=1.0,
    format_penalty=0.0,
):
    """Reference SPADER reward with per-entity, per-step loops (and alias-aware whole-word matching)."""
    bsz, length = response_mask.shape
    out = torch.zeros(bsz, length)
    if cost == 0 or global_step < free:
        c_eff = 0.0
    elif ramp > 0 and global_step - free < ramp:
        c_eff = cost * (global_step - free) / ramp
    else:
        c_eff = cost
    found_sets = []
    for i in range(bsz):
        gt = normalize_ground_truth(ground_truths[i])
        per_step = []
        for step in step_documents[i]:
            found: set[int] = set()
            for doc in [step] if isinstance(step, str) else step:  # one text, or the step's documents
                norm = normalize_answer(doc)
                found |= {
                    e for e, aliases in enumerate(gt.aliases) if any(_contains_words(norm, a) for a in aliases)
                }
            per_step.append(found)
        found_sets.append((gt, per_step))
    for i in range(bsz):
        gt, per_step = found_sets[i]
        spans = loop_steps(response_mask[i])
        n_gt = len(gt)
        seen: set[int] = set()
        for s, (_, b) in enumerate(spans):
            r = 0.0
            if s < len(per_step) and n_gt > 0:
                new = per_step[s] - seen
                seen |= per_step[s]
                for e in new:
                    n_e = sum(
                        1
                        for j in range(bsz)
                        if index[j] == index[i] and any(e in st for st in found_sets[j][1])
                    )
                    r += alpha + beta * math.exp(-lam * (n_e - 1))
                r = (r - c_eff * float(query_counts[i][s])) / n_gt
            if s == len(spans) - 1:
                r += w_final * float(f1[i]) if format_ok[i] else -format_penalty
            out[i, b - 1] += r
        if not spans and length:
            out[i, 0] += w_final * float(f1[i]) if format_ok[i] else -format_penalty
    return out
