"""Streaming access to a passage corpus and a memory-mapped document store.

Corpus convention (Pyserini / Search-R1 style): JSON lines ``{"id": str, "title": str, "contents": str}``
plus optional extra keys. Large corpora (Wikipedia at ~20M passages) are never held in a Python
list: :func:`iter_corpus` streams them, and :class:`DocStore` serves passages by row number from
a compact on-disk copy through ``mmap`` plus an ``int64`` offsets array.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "docs.offsets.npy"


class CorpusError(ValueError):
    """A corpus line that cannot be used (bad JSON, missing ``contents``)."""


@dataclass(frozen=True)
class Passage:
    """One corpus row, normalised: ``title`` may be empty, ``contents`` may not."""

    id: str
    title: str
    contents: str


def passage_from_record(record: Mapping[str, Any], row: int) -> Passage:
    """Normalise a corpus record. A missing ``id`` becomes the row number (Pyserini docid style)."""
    contents = record.get("contents")
    if contents is None:
        contents = record.get("text")
    if not isinstance(contents, str):
        raise CorpusError(f"row {row}: 'contents' must be a string, got {type(contents).__name__}")
    title = record.get("title")
    if title is None and isinstance(record.get("meta"), Mapping):  # QAMPARI chunk format
        title = record["meta"].get("title")
    if title is None or (isinstance(title, float) and title != title):  # missing, or NaN from pandas
        title = ""
    doc_id = record.get("id", row)
    return Passage(id=str(doc_id), title=str(title), contents=contents)


def iter_corpus(path: str | os.PathLike, *, skip_bad: bool = False) -> Iterator[Passage]:
    """Stream passages from a JSON-lines file, one line at a time (blank lines are ignored).

    With ``skip_bad`` a malformed line is skipped instead of raising :class:`CorpusError`;
    :func:`count_bad_lines` style accounting is left to the caller through ``row`` gaps.
    """
    with open(path, encoding="utf-8") as handle:
        for row, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                yield passage_from_record(json.loads(line), row)
            except (json.JSONDecodeError, CorpusError) as err:
                if skip_bad:
                    continue
                raise CorpusError(f"{path}:{row + 1}: {err}") from err


def iter_records(records: Iterable[Mapping[str, Any]]) -> Iterator[Passage]:
    """Passages from any iterable of mappings (e.g. ``DataFrame.to_dict('records')`` in chunks)."""
    for row, record in enumerate(records):
        yield passage_from_record(record, row)


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file, read in chunks (the corpus hash recorded in the index manifest)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


class DocStoreWriter:
    """Append passages to ``docs.jsonl`` and remember where each line starts.

    The running SHA-256 of the written lines identifies the corpus content independently of
    its source file's formatting (it is the ``corpus.sha256`` of the manifest).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.directory / DOCS_FILE, "wb")  # noqa: SIM115 - closed in close()
        self._offsets = array("q", [0])  # 8 bytes per passage (a list of ints costs ~36)
        self._digest = hashlib.sha256()
        self._position = 0

    def add(self, passage: Passage) -> None:
        line = json.dumps(
            {"id": passage.id, "title": passage.title, "contents": passage.contents}, ensure_ascii=False
        ).encode("utf-8") + b"\n"
        self._handle.write(line)
        self._digest.update(line)
        self._position += len(line)
        self._offsets.append(self._position)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def close(self) -> None:
        self._handle.close()
        np.save(self.directory / OFFSETS_FILE, np.frombuffer(self._offsets, dtype=np.int64))


class DocStore:
    """Read-only passages by row number, backed by ``mmap`` (pages are loaded on demand).

    Memory cost is the OS page cache only; a 20M-passage store never becomes Python objects.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        # a plain ndarray view of the mapped file: np.memmap's own indexing is ~10x slower per item
        self._offsets = np.asarray(np.load(directory / OFFSETS_FILE, mmap_mode="r"))
        self._file = open(directory / DOCS_FILE, "rb")  # noqa: SIM115 - closed in close()
        size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, row: int) -> dict[str, str]:
        """The passage at ``row`` as ``{"id", "title", "contents"}``."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} outside 0..{len(self) - 1}")
        start, end = self._offsets[row : row + 2].tolist()
        return orjson.loads(self._map[start:end])

    def get_many(self, rows: np.ndarray) -> list[dict[str, str]]:
        """:meth:`get` for each of ``rows`` (non-negative int array from a retriever), offsets looked up
        at once (a row past the end raises IndexError)."""
        rows = np.asarray(rows, dtype=np.int64)
        data, loads = self._map, orjson.loads
        return [loads(data[s:e]) for s, e in zip(self._offsets[rows].tolist(), self._offsets[rows + 1].tolist(),
                                                  strict=True)]

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        self._file.close()
