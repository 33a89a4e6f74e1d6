"""Toy data shared by the native-trainer tests (a uniquely named helper module, not conftest)."""

from __future__ import annotations

GROUPS = {
    "Country in West Africa": ["Ghana", "Senegal", "Mali", "Togo"],
    "Play by William Shakespeare": ["Hamlet", "Macbeth", "Othello"],
    "Family of birds": ["Corvidae", "Strigidae"],
}
QUESTIONS = [
    {"id": f"q{i}", "question": f'Which articles match the description "{d}"?', "ground_truth": [[t] for t in titles]}
    for i, (d, titles) in enumerate(GROUPS.items())
]
TEMPLATE = "Search with <tool_call>[\"query\"]</tool_call>, answer with <answer>[\"X\"]</answer>.\nQuestion: {question}"


def corpus_records() -> list[dict[str, str]]:
    return [
        {"id": f"p{i}", "title": t, "contents": f"{d}. {t} is described here with a few more words."}
        for i, (d, t) in enumerate((d, t) for d, ts in GROUPS.items() for t in ts)
    ]
