"""A scripted search policy: a model-free baseline and the source of warm-start demonstrations.

It only uses what a model would see — the question and the retrieved passages:

1. search with the question's content words (a quoted phrase in the question is used verbatim);
2. read each retrieved passage's *evidence line* (its first sentence; in the embedded corpus the
   article's short description, e.g. ``"Country in West Africa"``), score every distinct line by
   how many of the question's content words it contains, and pick the best line;
3. optionally search again with that line verbatim (it is the phrase passages of the answer set
   share), then answer with the titles of every retrieved passage whose evidence line equals the
   chosen line. With no line reaching ``min_overlap`` it answers an empty list.

Every turn is a protocol-conformant text (``<think>…</think>`` + one action), so trajectories can be
tokenised for supervised warm start exactly like model rollouts. The thoughts are short and never
quote a passage: a small model imitates them, and a thought that repeats the evidence line right
before ``<answer>`` taught SmolLM2 to answer with that line instead of the titles (and long turns
were cut by the per-turn token limit).

A question that names several *facets* of one head (the multi-search task, docs/data.md: *Which
Czech, French or Russian composers are there?*, *Which countries are in East Asia or West Africa?*,
*Which chemical elements have atomic numbers from 21 to 30?*) is decomposed from its text alone
(:func:`parse_facets`); the policy then searches once per facet (one query per turn), searches a
facet again when every passage it returned matched it (the facet may have more members), and
answers the titles whose evidence line names the head and one facet. With ``query_style="varied"``
the facet order and each query's wording are drawn per question from ``seed`` and the question id,
so demonstrations do not teach a single query template. A question with one facet (every question
of the default task) takes the path above.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from spader_pipeline.agent.question_facets import STOPWORDS, WORD_RE, QuestionFacets, parse_facets, stem
from spader_pipeline.agent.types import GeneratedTurn, Generator, RolloutState, Step

_QUOTED_RE = re.compile(r"[\"“]([^\"”]{2,200})[\"”]")

def content_words(text: str) -> list[str]:
    """Words of ``text`` minus question words and stopwords (original spelling, order kept)."""
    return [w for w in WORD_RE.findall(text) if w.lower() not in STOPWORDS]


def question_query(question: str) -> str:
    """The first search query for ``question``: a quoted phrase if any, else its content words."""
    quoted = _QUOTED_RE.search(question)
    if quoted:
        return quoted.group(1).strip()
    words = content_words(question)
    return " ".join(words) if words else question.strip()


def evidence_line(contents: str) -> str:
    """The first sentence of a passage (cut at the first ``". "`` or newline)."""
    text = contents.strip()
    cut = [i for i in (text.find(". "), text.find("\n")) if i >= 0]
    return (text[: min(cut)] if cut else text).strip().rstrip(".")


def _key(line: str) -> str:
    return " ".join(w.lower() for w in WORD_RE.findall(line))


@dataclass(frozen=True)
class _Hit:
    title: str
    line: str


# --------------------------------------------------------------------------------------------------
# Questions with several facets (the multi-search task, docs/data.md)
# --------------------------------------------------------------------------------------------------

_FIRST_FACET = "Search each group in turn."
_NEXT_FACET = "Search the next group."
_AGAIN = "All matched; search it again."
_FACET_ANSWER = "The titles whose first line names a group."


QueryStyle = Literal["fixed", "varied"]


class ScriptedPolicy(Generator):
    """Rule-based agent (see the module docstring).

    Args:
        follow_up: search a second time before answering: with the chosen evidence line (one
            facet), or once more for each facet whose search returned only matching passages.
        min_overlap: least fraction of the question's content words the chosen line must contain
            (one facet).
        query_style: several facets: ``fixed`` searches the facets in question order with one
            wording; ``varied`` draws the order and each query's wording from ``seed`` and the
            question id.
        seed: seed of the ``varied`` draws.
        max_searches: several facets: most searches before answering (keep it below the rollout's
            ``max_turns``); None: one per facet plus the follow-ups.
    """

    def __init__(
        self,
        *,
        follow_up: bool = True,
        min_overlap: float = 0.5,
        query_style: QueryStyle = "fixed",
        seed: int = 0,
        max_searches: int | None = 5,
    ) -> None:
        if query_style not in ("fixed", "varied"):
            raise ValueError(f"query_style must be 'fixed' or 'varied', not {query_style!r}")
        if max_searches is not None and max_searches < 1:
            raise ValueError(f"max_searches must be at least 1 (or None), not {max_searches}")
        self.follow_up = follow_up
        self.min_overlap = min_overlap
        self.query_style = query_style
        self.seed = seed
        self.max_searches = max_searches

    async def generate(self, states: Sequence[RolloutState]) -> list[GeneratedTurn]:
        return [GeneratedTurn(text=self.turn(state)) for state in states]

    def turn(self, state: RolloutState) -> str:
        """The next assistant turn for ``state`` (pure function of question and observations)."""
        question = str(state.sample["question"])
        searches = [s for s in state.steps if s.kind == "search"]
        facets = parse_facets(question)
        if facets is not None:
            return self.facet_turn(facets, self.plan(facets, state.sample), searches)
        if not searches:
            query = question_query(question)
            return _search_turn("Search the question's key words.", [query])
        hits = [
            _Hit(title, evidence_line(text.split("\n", 1)[1] if "\n" in text else text))
            for step in searches
            for title, text in zip(_flat(step.titles), step.retrieved_texts, strict=False)
        ]
        best = self.best_line(question, hits)
        if best is None:
            return _answer_turn("No passage matches.", [])
        if self.follow_up and len(searches) == 1 and _key(best) != _key(searches[0].queries[0]):
            return _search_turn("Search the first line the matching passages share.", [best])
        titles = list(dict.fromkeys(h.title for h in hits if _key(h.line) == _key(best) and h.title))
        return _answer_turn("The titles of the matching passages.", titles)

    def best_line(self, question: str, hits: Sequence[_Hit]) -> str | None:
        """The evidence line that covers most of the question's content words (None if too little)."""
        wanted = {stem(w) for w in content_words(question)}
        if not wanted:
            return None
        scored: dict[str, tuple[float, int, int, str]] = {}
        for hit in hits:
            key = _key(hit.line)
            if not key:
                continue
            stems = {stem(w) for w in key.split()}
            overlap = len(wanted & stems) / len(wanted)
            extra = len(stems - wanted)
            count = scored[key][2] + 1 if key in scored else 1
            scored[key] = (overlap, -extra, count, hit.line)
        if not scored:
            return None
        overlap, _, _, line = max(scored.values(), key=lambda v: v[:3])
        return line if overlap >= self.min_overlap else None

    # -- several facets ------------------------------------------------------------------------

    def plan(self, facets: QuestionFacets, sample: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        """(facet, wording of its search, wording of its follow-up) in search order.

        ``fixed``: question order, wording 0, follow-up wording 1. ``varied``: a permutation and
        wordings drawn from ``seed`` and the sample's id (its question when it has none).
        """
        n_wordings = len(facets.queries(0))
        if self.query_style == "fixed":
            return [(i, 0, 1) for i in range(len(facets.facets))]
        key = f"{self.seed}|{sample.get('id') or sample['question']}"
        rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
        order = list(range(len(facets.facets)))
        rng.shuffle(order)
        plan = []
        for i in order:
            first = rng.randrange(n_wordings)
            plan.append((i, first, (first + 1 + rng.randrange(n_wordings - 1)) % n_wordings))
        return plan

    def facet_turn(self, facets: QuestionFacets, plan: Sequence[tuple[int, int, int]], searches: Sequence[Step]) -> str:
        """The next turn for a question with several facets, given the searches made so far:
        the plan's searches, then follow-ups, then the answer (``max_searches`` bounds both)."""
        budget = len(searches) < (self.max_searches or len(plan) * 2)
        if len(searches) < len(plan) and budget:
            i, wording, _ = plan[len(searches)]
            thought = _NEXT_FACET if searches else _FIRST_FACET
            return _search_turn(thought, [facets.queries(i)[wording]])
        hits = [_hits(step) for step in searches]
        if self.follow_up and budget:
            full = [
                (i, again)
                for (i, _, again), step_hits in zip(plan, hits, strict=False)
                if step_hits and all(facets.match(h.line) == i for h in step_hits)
            ]
            done = len(searches) - len(plan)
            if done < len(full):
                i, again = full[done]
                return _search_turn(_AGAIN, [facets.queries(i)[again]])
        matched = (h.title for step_hits in hits for h in step_hits if h.title and facets.match(h.line) is not None)
        titles = list(dict.fromkeys(matched))
        return _answer_turn(_FACET_ANSWER if titles else "No passage matches.", titles)


def _hits(step: Step) -> list[_Hit]:
    """(title, evidence line) of each passage a search step retrieved."""
    return [
        _Hit(title, evidence_line(text.split("\n", 1)[1] if "\n" in text else text))
        for title, text in zip(_flat(step.titles), step.retrieved_texts, strict=False)
    ]


def _flat(nested: Sequence[Sequence[str]]) -> list[str]:
    return [x for inner in nested for x in inner]


def _search_turn(thought: str, queries: list[str]) -> str:
    return f"<think>{thought}</think>\n<tool_call>{json.dumps(queries, ensure_ascii=False)}</tool_call>"


def _answer_turn(thought: str, answers: list[str]) -> str:
    return f"<think>{thought}</think>\n<answer>{json.dumps(answers, ensure_ascii=False)}</answer>"
