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
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from spader_pipeline.agent.rollout import GeneratedTurn, Generator, RolloutState

_WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)
_QUOTED_RE = re.compile(r"[\"“]([^\"”]{2,200})[\"”]")
_STOPWORDS = frozenset(
    """a an the of in on at to for from by with and or is are was were be been being which what who whom
    whose where when why how that this these those there their its it as did do does done has have had
    all any every each some list name find give tell me us known also than into about under over after
    before such many much most other same one ones article articles wikipedia have short description""".split()
)


def _stem(word: str) -> str:
    """A tiny plural folding (countries→country, plays→play, classes→class), enough for matching."""
    w = word.lower()
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 4 and w.endswith(("sses", "shes", "ches", "xes")):
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        return w[:-1]
    return w


def content_words(text: str) -> list[str]:
    """Words of ``text`` minus question words and stopwords (original spelling, order kept)."""
    return [w for w in _WORD_RE.findall(text) if w.lower() not in _STOPWORDS]


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
    return " ".join(w.lower() for w in _WORD_RE.findall(line))


@dataclass(frozen=True)
class _Hit:
    title: str
    line: str


class ScriptedPolicy(Generator):
    """Rule-based agent (see the module docstring).

    Args:
        follow_up: search a second time with the chosen evidence line before answering.
        min_overlap: least fraction of the question's content words the chosen line must contain.
    """

    def __init__(self, *, follow_up: bool = True, min_overlap: float = 0.5) -> None:
        self.follow_up = follow_up
        self.min_overlap = min_overlap

    async def generate(self, states: Sequence[RolloutState]) -> list[GeneratedTurn]:
        return [GeneratedTurn(text=self.turn(state)) for state in states]

    def turn(self, state: RolloutState) -> str:
        """The next assistant turn for ``state`` (pure function of question and observations)."""
        question = str(state.sample["question"])
        searches = [s for s in state.steps if s.kind == "search"]
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
        wanted = {_stem(w) for w in content_words(question)}
        if not wanted:
            return None
        scored: dict[str, tuple[float, int, int, str]] = {}
        for hit in hits:
            key = _key(hit.line)
            if not key:
                continue
            stems = {_stem(w) for w in key.split()}
            overlap = len(wanted & stems) / len(wanted)
            extra = len(stems - wanted)
            count = scored[key][2] + 1 if key in scored else 1
            scored[key] = (overlap, -extra, count, hit.line)
        if not scored:
            return None
        overlap, _, _, line = max(scored.values(), key=lambda v: v[:3])
        return line if overlap >= self.min_overlap else None


def _flat(nested: Sequence[Sequence[str]]) -> list[str]:
    return [x for inner in nested for x in inner]


def _search_turn(thought: str, queries: list[str]) -> str:
    return f"<think>{thought}</think>\n<tool_call>{json.dumps(queries, ensure_ascii=False)}</tool_call>"


def _answer_turn(thought: str, answers: list[str]) -> str:
    return f"<think>{thought}</think>\n<answer>{json.dumps(answers, ensure_ascii=False)}</answer>"
