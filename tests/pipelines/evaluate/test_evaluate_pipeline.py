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


def _latest(path):
    return sorted(path.iterdir())[-1] / path.name


@pytest.mark.e2e
@pytest.mark.slow
def test_evaluate_session_run_with_scripted_policy(kedro_project, caplog):
    _write_inputs(kedro_project)
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["index_build", "evaluate"])

    samples = pd.read_json(
        _latest(kedro_project / "data/07_model_output/eval_samples.jsonl"), lines=True, dtype={"id": str}
    )
    assert len(samples) == 4 and set(samples["model"]) == {"scripted"} and set(samples["status"]) == {"ok"}
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
        ("scripted", "embedded_test")
    ]
    assert table.loc[0, "f1"] == 1.0 and table.loc[0, "num_failed"] == 0
    assert _latest(kedro_project / "data/08_reporting/eval_comparison.png").stat().st_size > 1000
    assert "skipping model base" in caplog.text  # no checkpoint in this project: skipped, logged

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
    work = list((kedro_project / "data/07_model_output/eval_work").iterdir())
    assert len(work) == 1 and len(work[0].read_text().splitlines()) == 4
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["evaluate"])
    assert len(work[0].read_text().splitlines()) == 4
    assert "resuming, 4 of 4 samples already done" in caplog.text
