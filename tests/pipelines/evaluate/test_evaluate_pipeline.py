"""A real ``kedro run --pipeline index_build,evaluate --env test`` on a small fixture, through
KedroSession: a retrieval server started and stopped by the node, the scripted policy, versioned
outputs, nested MLflow runs with artifacts, resume on rerun, unavailable models skipped."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest
from kedro.framework.session import KedroSession

GROUPS = {
    "Country in West Africa": ["Ghana", "Togo", "Mali", "Senegal"],
    "Play by William Shakespeare": ["Hamlet", "Macbeth", "Othello"],
    "Family of birds": ["Corvidae", "Strigidae"],
    "Country in East Africa": ["Kenya", "Uganda"],
}
QUESTIONS = [
    ("q1", "Which countries are in West Africa?", "Country in West Africa"),
    ("q2", "Which plays were written by William Shakespeare?", "Play by William Shakespeare"),
    ("q3", 'Which Wikipedia articles have the short description "Family of birds"?', "Family of birds"),
    ("q4", "Which countries are in East Africa?", "Country in East Africa"),
]


def _write_inputs(root):
    rows = [
        {"id": str(i), "title": title, "contents": f"{desc}. {title} is described here in a few words."}
        for i, (desc, title) in enumerate((d, t) for d, ts in GROUPS.items() for t in ts)
    ]
    (root / "data/03_primary").mkdir(parents=True)
    (root / "data/03_primary/corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "data/05_model_input/eval").mkdir(parents=True)
    lines = [
        {"id": qid, "question": q, "ground_truth": [[t] for t in GROUPS[d]], "data_source": "embedded"}
        for qid, q, d in QUESTIONS
    ]
    (root / "data/05_model_input/eval/embedded_test.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines)
    )
    # a tiny untrained checkpoint where the `base` entry looks for it (in-process HF backend)
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_base_model

    spec = TinyQwen3Spec(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    texts = [r["contents"] for r in rows] * 3
    build_base_model(texts, root / "data/06_models/base_model", spec=spec, vocab_size=500, min_frequency=1)


def _latest(path):
    return sorted(path.iterdir())[-1] / path.name


@pytest.mark.e2e
@pytest.mark.slow
def test_evaluate_session_run_scripted_and_hf(kedro_project, caplog):
    _write_inputs(kedro_project)
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["index_build", "evaluate"])

    samples = pd.read_json(
        _latest(kedro_project / "data/07_model_output/eval_samples.jsonl"), lines=True, dtype={"id": str}
    )
    assert len(samples) == 8 and set(samples["status"]) == {"ok"}
    base = samples[samples["model"] == "base"]
    assert len(base) == 4 and (base["format_error"] == 1.0).all()  # untrained: never a valid answer
    samples = samples[samples["model"] == "scripted"]
    assert {
        "id",
        "question",
        "ground_truth",
        "data_source",
        "history",
        "predicted",
        "f1",
        "recall_at_5",
    } <= set(samples.columns)
    row = samples.set_index("id").loc["q1"]
    assert sorted(row["predicted"]) == sorted(GROUPS["Country in West Africa"])
    table = pd.read_csv(_latest(kedro_project / "data/08_reporting/eval_table.csv"))
    assert list(table[["model", "dataset"]].itertuples(index=False, name=None)) == [
        ("scripted", "embedded_test"),
        ("base", "embedded_test"),
    ]
    assert table.loc[0, "f1"] == 1.0 and table.loc[0, "num_failed"] == 0
    assert _latest(kedro_project / "data/08_reporting/eval_comparison.png").stat().st_size > 1000
    assert "skipping model qwen3-8b-spader" in caplog.text  # no endpoint configured: skipped, logged

    # one parent run for the kedro run, one nested run per evaluation, with artifacts
    runs = mlflow.search_runs(
        experiment_names=["spader-pipeline-test"], output_format="list", order_by=["start_time DESC"]
    )
    nested = [r for r in runs if r.info.run_name == "evaluate:scripted:embedded_test"][0]
    parent = mlflow.get_run(nested.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["kedro.pipeline"] == "index_build,evaluate"
    assert parent.data.metrics["evaluation/scripted/embedded_test/f1"] == 1.0
    assert nested.data.params["model"] == "scripted" and nested.data.params["dataset"] == "embedded_test"
    assert nested.data.metrics["recall"] == 1.0
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(nested.info.run_id)}
    assert artifacts == {"plots", "samples"}

    # rerun: every sample comes from the work file (resume), results identical
    work = sorted((kedro_project / "data/07_model_output/eval_work").iterdir())
    assert [w.name.split("__")[0] for w in work] == ["base", "scripted"]
    assert all(len(w.read_text().splitlines()) == 4 for w in work)
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["evaluate"])
    assert all(len(w.read_text().splitlines()) == 4 for w in work)
    assert caplog.text.count("resuming, 4 of 4 samples already done") == 2
