"""Measure the multi-search embedded task (docs/data.md, "The multi-search task").

Per split: question counts, answers per question (quartiles), sub-groups per question, and the
recall that BM25 over the real corpus allows with 1, 2 and 4 searches of ``--topk`` passages:

- oracle: searches the question's sub-group descriptions, largest sub-group first; with one search
  it takes the better of that and the question's own content words (``agent.scripted.question_query``);
- scripted: ``agent.scripted.ScriptedPolicy``'s single-facet choices (question words, then the best
  evidence line), answering the titles whose evidence line matches, with 1 and 2 searches;
- policy: ``ScriptedPolicy`` itself, rolled out through ``agent.rollout.run_rollouts`` (it parses
  the question's facets, searches each, follows up, answers): the recall of its answers with its
  own number of searches (``fixed`` and ``varied`` wordings, without follow-ups) and with one
  search, and the mean number of searches.

Recall counts an answer when a retrieved passage belongs to it (oracle, scripted) or when the
policy answers its title (policy). Usage (the index is built once and cached)::

    PYTHONPATH=src python scripts/measure_multi_search_task.py [--topk 3] [--index /tmp/multi_search_bm25]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.scripted import ScriptedPolicy, _Hit, evidence_line, question_query
from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.data import multi_search_qa, wiki
from spader_pipeline.retrieval.bm25 import BM25Params, BM25Retriever, build_bm25
from spader_pipeline.retrieval.corpus import Passage
from spader_pipeline.retrieval.schemas import Document, QueryResult, SearchResponse

ROOT = Path(__file__).resolve().parents[1]


def _params() -> dict:
    conf = yaml.safe_load((ROOT / "conf/base/parameters_data_prep.yml").read_text())["data_prep"]
    qa = conf["embedded_qa"]
    return {"salt": qa["salt"], **qa["multi_search"]}, conf["corpus"]


class CorpusSearch:
    """The rollout loop's search backend over the BM25 index and the passages in memory."""

    def __init__(self, retriever: BM25Retriever, passages: list[dict]) -> None:
        self.retriever, self.passages = retriever, passages

    async def search(self, queries, topk: int = 5, max_chars: int | None = None) -> SearchResponse:
        results = []
        for query in queries:
            rows, scores = self.retriever.top(query, topk)
            docs = [Document(score=float(s), **self.passages[int(r)]) for r, s in zip(rows, scores, strict=True)]
            results.append(QueryResult(query=query, documents=docs))
        return SearchResponse(results=results)


#: the policy variants measured: name → ScriptedPolicy options
POLICIES = {
    "fixed": {},
    "fixed_1_search": {"max_searches": 1},
    "fixed_no_follow_up": {"follow_up": False},
    "varied": {"query_style": "varied"},
}


def replay_policy(questions, backend, topk: int, template: str) -> dict:
    """Recall (of the answered titles), precision and searches of each of ``POLICIES``."""
    rows = multi_search_qa.question_rows(questions)
    samples = [{"id": row["id"], "question": row["question"]} for row in rows]
    config = RolloutConfig(max_turns=12, topk=topk, max_chars=None)
    out = {}
    for name, options in POLICIES.items():
        trajectories = run_rollouts_sync(samples, ScriptedPolicy(**options), backend, config, template)
        recalls, precisions = [], []
        for q, t in zip(questions, trajectories, strict=True):
            predicted = set(t.predicted or ())
            recalls.append(len(predicted & set(q.titles)) / len(q.titles))
            precisions.append(len(predicted & set(q.titles)) / len(predicted) if predicted else 0.0)
        out[name] = {
            "recall": round(statistics.mean(recalls), 3),
            "precision": round(statistics.mean(precisions), 3),
            "searches": round(statistics.mean(t.num_searches for t in trajectories), 2),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--index", default="/tmp/multi_search_bm25")
    parser.add_argument("--set", default="{}", help="JSON overrides of embedded_qa.multi_search")
    args = parser.parse_args()

    params, corpus = _params()
    params.update(json.loads(args.set))
    articles = wiki.load_wiki_articles()
    passages = list(wiki.iter_passages(articles, corpus["words_per_chunk"], corpus["description_prefix"]))
    index = Path(args.index)
    if not (index / "tokenizer.json").exists():
        build_bm25((Passage(**p) for p in passages), index, BM25Params(), show_progress=False)
    retriever = BM25Retriever(index)
    backend = CorpusSearch(retriever, passages)
    template = resolve_template(yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"])

    def search(query: str) -> list[dict]:
        rows, _ = retriever.top(query, args.topk)
        return [passages[int(r)] for r in rows]

    def recall(found: set[str], answers: list[str]) -> float:
        return len(found & set(answers)) / len(answers)

    scripted = ScriptedPolicy()
    questions = multi_search_qa.build_questions(articles, params)
    report = {"topk": args.topk, "splits": {}}
    for split in ("train", "validation", "test"):
        qs = [q for q in questions if q.split == split]
        sizes = [len(q.titles) for q in qs]
        oracle = {1: [], 2: [], 4: []}
        script = {1: [], 2: []}
        for q in qs:
            order = sorted(zip(q.subgroups, q.queries, strict=True), key=lambda gq: -len(gq[0].titles))
            queries = [query for _, query in order]
            first = question_query(q.question)
            for n in oracle:
                found = {p["title"] for query in queries[:n] for p in search(query)}
                if n == 1:
                    found = max(found, {p["title"] for p in search(first)}, key=lambda f: recall(f, q.titles))
                oracle[n].append(recall(found, q.titles))
            hits = [_Hit(p["title"], evidence_line(p["contents"])) for p in search(first)]
            for n in script:
                best = scripted.best_line(q.question, hits)
                if n == 2 and best is not None:
                    hits = hits + [_Hit(p["title"], evidence_line(p["contents"])) for p in search(best)]
                    best = scripted.best_line(q.question, hits)
                chosen = {h.title for h in hits if best is not None and h.line.lower() == best.lower()}
                script[n].append(recall(chosen, q.titles))
        quartiles = statistics.quantiles(sizes, n=4) if len(sizes) > 1 else sizes * 3
        report["splits"][split] = {
            "questions": len(qs),
            "heads": len({q.key for q in qs}),
            "answers_q1_median_q3": [quartiles[0], statistics.median(sizes), quartiles[2]],
            "answers_max": max(sizes),
            "subgroups_mean": round(statistics.mean(len(q.subgroups) for q in qs), 2),
            "oracle_recall": {n: round(statistics.mean(v), 3) for n, v in oracle.items()},
            "scripted_recall": {n: round(statistics.mean(v), 3) for n, v in script.items()},
            "policy": replay_policy(qs, backend, args.topk, template),
        }
    train_sets = {frozenset(q.titles) for q in questions if q.split == "train"}
    held_out = {frozenset(q.titles) for q in questions if q.split != "train"}
    report["answer_sets_shared_train_heldout"] = len(train_sets & held_out)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
