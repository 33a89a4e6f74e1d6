"""Toy corpus and questions shared by the agent tests (a plain module: `conftest` names are not importable
reliably when several test folders have one)."""

from __future__ import annotations

GROUPS = {
    "Country in West Africa": {
        "Ghana": "Ghana lies on the Gulf of Guinea; its capital is Accra and cocoa is a main export.",
        "Senegal": "Senegal is the westernmost country of the mainland, with Dakar as its capital.",
        "Mali": "Mali is a landlocked country whose capital is Bamako, on the Niger river.",
        "Togo": "Togo is a narrow country between Ghana and Benin with Lome as its capital.",
    },
    "Play by William Shakespeare": {
        "Hamlet": "Hamlet is a tragedy set in Denmark about a prince who avenges his father.",
        "Macbeth": "Macbeth is a tragedy about a Scottish general who murders the king.",
        "Othello": "Othello is a tragedy about a Moorish general deceived by his ensign Iago.",
    },
    "Family of birds": {
        "Corvidae": "Corvidae are crows, ravens, jays and magpies, known for intelligence.",
        "Strigidae": "Strigidae are the true owls, mostly nocturnal birds of prey.",
    },
    "Country in East Africa": {
        "Kenya": "Kenya has Nairobi as its capital and is known for savannah wildlife.",
        "Uganda": "Uganda is a landlocked country on Lake Victoria with Kampala as capital.",
    },
}

QUESTIONS = [
    {
        "id": "q-west",
        "question": "Which countries are in West Africa?",
        "ground_truth": [[t] for t in GROUPS["Country in West Africa"]],
        "data_source": "toy",
    },
    {
        "id": "q-play",
        "question": "Which plays were written by William Shakespeare?",
        "ground_truth": [[t] for t in GROUPS["Play by William Shakespeare"]],
        "data_source": "toy",
    },
    {
        "id": "q-birds",
        "question": 'Which Wikipedia articles have the short description "Family of birds"?',
        "ground_truth": [["Corvidae", "crows"], ["Strigidae", "owls"]],
        "data_source": "toy",
    },
]


def corpus_records() -> list[dict[str, str]]:
    rows = []
    for description, members in GROUPS.items():
        for title, text in members.items():
            rows.append({"id": f"p{len(rows):03d}", "title": title, "contents": f"{description}. {text}"})
    return rows
