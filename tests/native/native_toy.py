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


def toy_trajectory(prompt, turns, predicted, retrieved, thinks=None):
    """A token-level trajectory: each turn is ``(model_tokens, observation_tokens)``; ``retrieved[k]``
    is the document text (or list of texts) turn ``k``'s search returned, ``thinks[k]`` its reasoning."""
    from spader_pipeline.agent.types import Step, Trajectory

    response, mask, steps = [], [], []
    for k, (model_tokens, obs_tokens) in enumerate(turns):
        start = len(response)
        response += model_tokens
        mask += [1] * len(model_tokens)
        text = f"<think>{thinks[k]}</think>" if thinks else "t"
        docs = (retrieved[k] if isinstance(retrieved[k], list) else [retrieved[k]]) if obs_tokens else []
        steps.append(Step(turn=k + 1, text=text, kind="search" if obs_tokens else "answer",
                          queries=("q",) if obs_tokens else (),
                          doc_ids=[[f"doc:{d}" for d in docs]] if obs_tokens else [],
                          retrieved_texts=docs,
                          token_span=(start, len(response))))
        response += obs_tokens
        mask += [0] * len(obs_tokens)
    return Trajectory(id="x", question="q", messages=[], steps=steps, finish_reason="answer", predicted=predicted,
                      prompt_ids=prompt, response_ids=response, response_mask=mask)


def toy_batch():
    """Four trajectories in two groups (``a``, ``b``) over the gold entities Ghana and Mali."""
    from spader_pipeline.native.batch import build_batch

    gt = [["Ghana"], ["Mali"]]
    trajs = [
        toy_trajectory([1, 2, 3], [([5, 6], [7, 8, 9]), ([10, 11], [])], ("Ghana",), ["Ghana is a country"]),
        toy_trajectory([1, 2, 3], [([5, 6], [7, 8, 9]), ([10, 11], [])], ("Mali",), ["nothing here"]),
        toy_trajectory([1, 2], [([5], [])], None, []),
        toy_trajectory([1, 2], [([5, 6, 7], [8]), ([9], [])], ("Ghana", "Mali"), ["Mali and Ghana"]),
    ]
    samples = [{"uid": "a", "ground_truth": gt}] * 2 + [{"uid": "b", "ground_truth": gt}] * 2
    return build_batch(trajs, samples, pad_id=0)
