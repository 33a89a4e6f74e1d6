"""Which groups a multi-search question names: its facets, read from the question text alone.

The multi-search task (``data.multi_search_qa``, docs/data.md) asks for the union of 2–4 description
groups that share a head and differ in one facet ("Which Czech, French or Russian composers are
there?"); :func:`parse_facets` recovers head and facets so the scripted policy can search one group
per turn, and :meth:`QuestionFacets.match` decides whether a passage's evidence line names one.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Literal

from .question_grammar import ELEMENT, IRREGULAR_SINGULARS, singular

WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)
STOPWORDS = frozenset(
    """a an the of in on at to for from by with and or is are was were be been being which what who whom
    whose where when why how that this these those there their its it as did do does done has have had
    all any every each some list name find give tell me us known also than into about under over after
    before such many much most other same one ones article articles wikipedia have short description""".split()
)


def stem(word: str) -> str:
    """A tiny plural folding (countries→country, plays→play, classes→class), enough for matching."""
    w = word.lower()
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 4 and w.endswith(("sses", "shes", "ches", "xes")):
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        return w[:-1]
    return w



_ELEMENTS_Q = re.compile(r"^Which chemical elements have atomic numbers from (\d+) to (\d+)\?$")
_IN_Q = re.compile(r"^Which (?P<names>[^,;\"“”]+?) are in (?P<list>[^\"“”]+)\?$")
_THERE_Q = re.compile(r"^Which (?P<body>[^\"“”]+) are there\?$")
_DATE_WORDS = frozenset("century c ca bc bce ad ce".split())
#: atomic numbers per search of an element-range question (a search returns ``topk`` = 3 passages)
NUMBERS_PER_SEARCH = 3


@dataclass(frozen=True)
class QuestionFacets:
    """What a several-facet question asks for, read from its text alone.

    ``form`` is how the question names the facets: ``leading`` (*Which Czech or French composers
    are there?*), ``in`` (*Which countries are in East Asia or West Africa?*), ``of`` (*Which kings
    of Dacia or Sweden are there?*) or ``elements`` (*Which chemical elements have atomic numbers
    from 21 to 30?*, one facet per ``NUMBERS_PER_SEARCH`` numbers). ``head`` is the shared noun
    phrase in the singular, ``names`` its plural as the question writes it, ``facets`` in question
    order; ``numbers``: the atomic numbers of each facet (``elements`` only). ``joined``: "X, Y or
    Z" may also be two facets, "X, Y" and "Z" (a list of two writes no "; "), so lines of "X, Y"
    count as facet 0 too. A line naming the whole list ("Genus of plants, fungi or algae") always
    counts as facet 0.
    """

    form: Literal["leading", "in", "of", "elements"]
    head: str
    names: str
    facets: tuple[str, ...]
    numbers: tuple[tuple[int, ...], ...] = ()
    joined: bool = False

    def description(self, i: int) -> str:
        """The short description the articles of facet ``i`` presumably share."""
        return self.queries(i)[0]

    def queries(self, i: int) -> list[str]:
        """Wordings of a search for facet ``i``; the first is the description itself."""
        f, h, n = self.facets[i], self.head, self.names
        if self.form == "elements":
            return [
                f"chemical element with atomic number {f}",
                f"elements with atomic numbers {f}",
                f"atomic number {f} chemical element",
                f"chemical elements {', '.join(f.split())}",
            ]
        if self.form == "leading":
            return [f"{f} {h}", f"{f} {n}", f"list of {f} {n}", f"{n}: {f}", f"{h}, {f}"]
        prep = self.form  # "in" | "of"
        return [f"{h} {prep} {f}", f"{n} {prep} {f}", f"list of {n} {prep} {f}", f"{f} {n}", f"{h}, {f}"]

    def match(self, line: str) -> int | None:
        """The facet whose description ``line`` (a passage's evidence line) is, or None.

        Descriptions compare by their words, folded to the singular, without years, ordinals,
        parentheses and stopwords ("French painter (1600–1650)" is facet "French" of head
        "painter"); element lines by their atomic number.
        """
        if self.form == "elements":
            found = ELEMENT.match(line.strip())
            number = int(found.group(1)) if found else None
            return next((i for i, numbers in enumerate(self.numbers) if number in numbers), None)
        signature = _signature(line)
        found = next((i for i in range(len(self.facets)) if _signature(self.description(i)) == signature), None)
        if found is None and (signature == _signature(" ".join((self.head, *self.facets))) or (
            self.joined and signature == _signature(self.description(0)) | _signature(self.facets[1])
        )):
            return 0
        return found


def parse_facets(question: str) -> QuestionFacets | None:
    """The facets of a question of the multi-search task; None unless it names at least two.

    Lists are written "A, B or C", or "A; B or C" when an item has a comma ("Maharashtra, India").
    In the ``leading`` form the last item also carries the head: when every other item is
    capitalised (nationalities: *Which Dutch or Swiss mathematicians and physicists are there?*)
    the head is what follows the last item's capitalised words, else its last word (*Which
    single-reed woodwind or brass instruments are there?*).
    """
    text = question.strip()
    found = _ELEMENTS_Q.match(text)
    if found:
        low, high = int(found.group(1)), int(found.group(2))
        if not 0 < low < high <= low + 200:
            return None
        span = list(range(low, high + 1))
        chunks = tuple(tuple(span[i : i + NUMBERS_PER_SEARCH]) for i in range(0, len(span), NUMBERS_PER_SEARCH))
        facets = tuple(" ".join(map(str, chunk)) for chunk in chunks)
        return QuestionFacets("elements", "chemical element", "chemical elements", facets, chunks) if len(chunks) > 1 else None
    found = _IN_Q.match(text)
    if found:
        return _facets("in", found["names"], _or_items(found["list"]), found["list"])
    found = _THERE_Q.match(text)
    if not found:
        return None
    body = found["body"]
    before, of, after = body.partition(" of ")
    if of and not re.search(r" or |[,;]", before):
        return _facets("of", before, _or_items(after), after)
    items = _or_items(body)
    if len(items) < 2:
        return None
    words = items[-1].split(" ")
    capitalised = sum(1 for _ in itertools.takewhile(lambda w: w[:1].isupper(), words))
    nationalities = all(w[:1].isupper() for item in items[:-1] for w in item.split(" "))
    cut = capitalised if nationalities and 0 < capitalised < len(words) else len(words) - 1
    if cut < 1:
        return None
    return _facets("leading", " ".join(words[cut:]), [*items[:-1], " ".join(words[:cut])])


def _facets(form: Literal["leading", "in", "of"], names: str, items: list[str], listed: str = "") -> QuestionFacets | None:
    names = names.strip()
    if len(items) < 2 or not names or not all(items):
        return None
    joined = len(items) == 3 and "; " not in listed  # "Maharashtra, India or Peru"
    return QuestionFacets(form, singular(names), names, tuple(items), joined=joined)


def _or_items(text: str) -> list[str]:
    """Items of "A, B or C" / "A; B or C" (one item when there is no " or ")."""
    head, sep, last = text.strip().rpartition(" or ")
    if not sep:
        return [text.strip()]
    return [item.strip() for item in head.split("; " if "; " in head else ", ")] + [last.strip()]


def _fold(word: str) -> str:
    """A word folded so that singular and plural agree (genera/genus, statesmen, niches/niche)."""
    lower = word.lower()
    lower = IRREGULAR_SINGULARS.get(lower, lower)
    if lower.endswith("men") and len(lower) > 3:
        lower = lower[:-3] + "man"
    folded = stem(lower)
    return folded.rstrip("e") or folded


def _signature(description: str) -> frozenset[str]:
    """A description's folded words without parentheses, numbers, dates and stopwords."""
    text = re.sub(r"\([^)]*\)?", " ", description)
    return frozenset(
        _fold(w)
        for w in WORD_RE.findall(text)
        if not any(c.isdigit() for c in w) and w.lower() not in STOPWORDS and w.lower() not in _DATE_WORDS
    )

