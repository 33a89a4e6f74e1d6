"""A Kedro dataset for corpora too large to load: ``load()`` returns a streaming handle.

``pandas.JSONDataset`` loads the whole corpus into a DataFrame, which is fine for the embedded
10k-passage default but not for a 20M-passage Wikipedia. Declaring the corpus as::

    corpus:
      type: spader_pipeline.retrieval.datasets.CorpusFileDataset
      filepath: data/03_primary/corpus.jsonl

makes ``load()`` return a :class:`CorpusFile` that ``index_build`` streams line by line;
``save()`` accepts a DataFrame or any iterable of ``{id, title, contents}`` mappings and writes
JSON lines incrementally.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kedro.io import AbstractDataset

from spader_pipeline.retrieval.corpus import Passage, iter_corpus


@dataclass(frozen=True)
class CorpusFile:
    """A JSON-lines corpus on disk; iterate it to stream :class:`Passage` objects."""

    path: Path

    def __iter__(self) -> Iterator[Passage]:
        return iter_corpus(self.path)


class CorpusFileDataset(AbstractDataset[Any, CorpusFile]):
    def __init__(self, filepath: str, metadata: dict[str, Any] | None = None) -> None:
        self._filepath = Path(filepath)
        self.metadata = metadata

    def load(self) -> CorpusFile:
        if not self._filepath.exists():
            raise FileNotFoundError(f"corpus file {self._filepath} does not exist")
        return CorpusFile(self._filepath)

    def save(self, data: Any) -> None:
        rows = data.itertuples(index=False) if hasattr(data, "itertuples") else data
        self._filepath.parent.mkdir(parents=True, exist_ok=True)
        with open(self._filepath, "w", encoding="utf-8") as handle:
            for row in rows:
                record = row._asdict() if hasattr(row, "_asdict") else dict(row)
                handle.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

    def _exists(self) -> bool:
        return self._filepath.exists()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath)}
