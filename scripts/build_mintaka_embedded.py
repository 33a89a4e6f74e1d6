"""Build the shipped Mintaka subset whose answers are all titles of the embedded corpus.

Mintaka (Sen et al., COLING 2022; amazon-science/mintaka, CC BY 4.0) questions in the unified
jsonl format are filtered to those with at least ``--min-answers`` answers, every one of which is
the title (or the disambiguator-free title) of an article in the embedded Wikipedia summaries.
Each answer gets the matched title as an extra surface form. Output: one unified row per
question with its provenance in ``meta``.

    python scripts/build_mintaka_embedded.py ../shared/data/mintaka_{dev,test,train}.jsonl \\
        --out src/spader_pipeline/data/resources/mintaka_embedded.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spader_pipeline.data.readers import title_aliases
from spader_pipeline.data.schema import dedupe_forms
from spader_pipeline.data.wiki import load_wiki_articles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="Mintaka files in the unified jsonl format")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-answers", type=int, default=2)
    args = parser.parse_args()

    by_name: dict[str, str] = {}
    for title in load_wiki_articles()["title"]:
        for form in title_aliases(title):
            by_name.setdefault(form.casefold(), title)

    kept, seen = [], set()
    for path in args.inputs:
        for line in path.open(encoding="utf-8"):
            row = json.loads(line)
            entities = row["ground_truth"]
            if len(entities) < args.min_answers or row["id"] in seen:
                continue
            titles = [next((by_name[f.casefold()] for f in entity if f.casefold() in by_name), None) for entity in entities]
            if any(title is None for title in titles):
                continue
            seen.add(row["id"])
            kept.append(
                {
                    "id": f"mintaka_embedded:{row['id']}",
                    "question": row["question"],
                    "ground_truth": [dedupe_forms([*entity, *title_aliases(title)]) for entity, title in zip(entities, titles, strict=True)],
                    "data_source": "mintaka_embedded",
                    "split": "test",
                    "meta": {"source": f"Mintaka ({path.name}), CC BY 4.0", "mintaka_id": row["id"], **row.get("meta", {})},
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as handle:
        for row in kept:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(kept)} questions to {args.out}")


if __name__ == "__main__":
    main()
