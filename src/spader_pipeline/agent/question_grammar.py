"""The grammar shared by the multi-search questions' writer (:mod:`spader_pipeline.data.multi_search_qa`)
and their reader (:mod:`.question_facets`): irregular plurals, the singular/plural of a noun
phrase's last word, and the description line of a chemical element."""

from __future__ import annotations

import re

#: singular → plural of the nouns the descriptions use that take no regular ending
IRREGULAR_PLURALS = {
    "genus": "genera", "phylum": "phyla", "subphylum": "subphyla", "species": "species",
    "series": "series", "child": "children", "people": "peoples", "phenomenon": "phenomena",
    "criterion": "criteria",
}
#: plural → singular, the same table read backwards
IRREGULAR_SINGULARS = {plural: one for one, plural in IRREGULAR_PLURALS.items()}
#: a chemical element's description (or a passage's first line): its atomic number
ELEMENT = re.compile(r"^chemical element with atomic number (?P<number>\d+)\b", re.IGNORECASE)
_PARTS = re.compile(r"( and |, )")


def pluralize(noun_phrase: str) -> str:
    """Plural of a noun phrase: the last word of each ``and``-joined part ("actor and filmmaker")."""
    return "".join(p if p in (" and ", ", ") else _plural_last(p) for p in _PARTS.split(noun_phrase))


def singular(noun_phrase: str) -> str:
    """The singular of a plural noun phrase: the last word of each ``and``-joined part."""
    return "".join(p if p in (" and ", ", ") else _singular_last(p) for p in _PARTS.split(noun_phrase))


def _plural_last(phrase: str) -> str:
    head, _, word = phrase.rpartition(" ")
    lower = word.lower()
    if lower in IRREGULAR_PLURALS:
        plural = IRREGULAR_PLURALS[lower]
    elif lower.endswith("man"):  # statesman, woman
        plural = word[:-3] + "men"
    elif re.search(r"[^aeiou]y$", lower):
        plural = word[:-1] + "ies"
    elif re.search(r"(s|x|z|ch|sh)$", lower):
        plural = word + "es"
    else:
        plural = word + "s"
    if word[:1].isupper() and not plural[:1].isupper():
        plural = plural[:1].upper() + plural[1:]
    return f"{head} {plural}" if head else plural


def _singular_last(phrase: str) -> str:
    head, _, word = phrase.rpartition(" ")
    lower = word.lower()
    if lower in IRREGULAR_SINGULARS:
        one = word[:1] + IRREGULAR_SINGULARS[lower][1:]
    elif lower.endswith("men") and len(lower) > 3:
        one = word[:-3] + "man"
    elif lower.endswith("ies") and len(lower) > 4:
        one = word[:-3] + "y"
    elif lower.endswith(("sses", "ches", "shes", "xes", "zzes")):
        one = word[:-2]
    elif lower.endswith("s") and not lower.endswith("ss"):
        one = word[:-1]
    else:
        one = word
    return f"{head} {one}" if head else one
