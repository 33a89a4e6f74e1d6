"""Text → token ids for BM25: lower-case word tokens, English stopwords, Snowball stemming.

The same :class:`Tokenizer` (with the vocabulary saved next to the index) is used at build and at
query time, so the two can never disagree. Word pattern and stopword list follow bm25s' defaults
(the Lucene English stopword set); stemming uses PyStemmer's Snowball English stemmer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

_WORD = re.compile(r"(?u)\b\w\w+\b")


@lru_cache(maxsize=4)
def _stemmer(language: str):
    import Stemmer  # PyStemmer

    stemmer = Stemmer.Stemmer(language)
    stemmer.maxCacheSize = 0  # PyStemmer's word cache costs more than it saves on open vocabularies (4x here)
    return stemmer


def _stopwords(name: str | None) -> frozenset[str]:
    if not name:
        return frozenset()
    from spader_pipeline.retrieval.bm25s_import import import_bm25s

    STOPWORDS_EN = import_bm25s().stopwords.STOPWORDS_EN  # noqa: N806 - bm25s' name

    if name not in ("en", "english"):
        raise ValueError(f"unknown stopword list {name!r} (known: 'en')")
    return frozenset(STOPWORDS_EN)


class Tokenizer:
    """Maps text to vocabulary ids; ``grow=True`` adds unseen tokens (building), else drops them."""

    def __init__(self, stemmer: str | None = "english", stopwords: str | None = "en",
                 vocab: dict[str, int] | None = None) -> None:
        self.stemmer_name = stemmer
        self.stopwords_name = stopwords
        self._stem = _stemmer(stemmer).stemWords if stemmer else None
        self._stop = _stopwords(stopwords)
        self.vocab: dict[str, int] = dict(vocab or {})

    def tokens(self, text: str) -> list[str]:
        words = _WORD.findall(text.lower())
        if self._stop:
            words = [w for w in words if w not in self._stop]
        return self._stem(words) if self._stem and words else words

    def ids(self, text: str, *, grow: bool = False) -> list[int]:
        vocab = self.vocab
        found = list(map(vocab.get, self.tokens(text)))  # one C-level pass; new tokens come back as None
        if None not in found:
            return found
        if not grow:
            return [i for i in found if i is not None]
        tokens = self.tokens(text)
        return [i if i is not None else vocab.setdefault(t, len(vocab)) for i, t in zip(found, tokens, strict=True)]

    def query_terms(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Distinct known token ids of a query and how often each occurs (a bag of words, as
        Pyserini's default query generator builds it): ``(ids [T] int64, counts [T] float32)``."""
        bag: dict[int, int] = {}
        vocab = self.vocab
        for token in self.tokens(text):
            i = vocab.get(token)
            if i is not None:
                bag[i] = bag.get(i, 0) + 1
        return (np.fromiter(bag.keys(), np.int64, len(bag)), np.fromiter(bag.values(), np.float32, len(bag)))

    def batch_ids(self, texts: Sequence[str], *, grow: bool = False) -> list[list[int]]:
        return [self.ids(t, grow=grow) for t in texts]
