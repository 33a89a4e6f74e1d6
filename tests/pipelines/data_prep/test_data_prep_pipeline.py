"""A real ``kedro run --pipeline data_prep --env test`` through KedroSession, tracked in MLflow."""

import json
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline.data.validation import DataQualityError

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "fixtures"


def _runs(experiment="spader-pipeline-test"):
    return mlflow.search_runs(experiment_names=[experiment], output_format="list", order_by=["start_time DESC"])


@pytest.mark.e2e
def test_data_prep_session_run(kedro_project):
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["data_prep"])

    corpus = pd.read_json(kedro_project / "data/03_primary/corpus.jsonl", lines=True, dtype={"id": str})
    assert list(corpus.columns) == ["id", "title", "contents"] and len(corpus) > 1500
    eval_dir = kedro_project / "data/05_model_input/eval"
    assert {p.name for p in eval_dir.iterdir()} >= {"embedded_test.jsonl", "embedded_validation.jsonl"}
    first = json.loads((eval_dir / "embedded_test.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "question", "ground_truth", "data_source"}
    train = pd.read_parquet(kedro_project / "data/05_model_input/verl/train.parquet")
    assert set(train.columns) >= {"prompt", "data_source", "reward_model", "extra_info", "agent_name"}
    # versioned datasets land in timestamped folders
    assert list((kedro_project / "data/03_primary/qa_unified.parquet").iterdir())

    run = _runs()[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["kedro.pipeline"] == "data_prep"
    assert run.data.tags["kedro.env"] == "test"
    assert run.data.tags["git.commit"]
    assert run.data.params["data_prep.wiki.limit"] == "1500"
    metrics = run.data.metrics
    assert metrics["data_prep/embedded/rows_in"] == metrics["data_prep/embedded/rows_clean"] > 0
    assert metrics["data_prep/embedded/rows_quarantined"] == 0
    assert metrics["data_prep/embedded/answers_per_question_mean"] >= 1


@pytest.mark.e2e
def test_data_prep_quality_gate_stops_run_and_keeps_quarantine(kedro_project):
    broken = {"name": "qampari", "format": "qampari", "path": str(FIXTURES / "qampari.jsonl"), "split": "test"}
    runtime = {"data_prep": {"benchmarks": [broken], "wiki": {"limit": 300}}}
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=runtime) as session:
        with pytest.raises(DataQualityError, match="qampari: 5/6 rows quarantined"):
            session.run(pipeline_names=["data_prep"])

    quarantine_dir = kedro_project / "data/02_intermediate/qa_quarantine.jsonl"
    (version,) = list(quarantine_dir.iterdir())
    quarantine = pd.read_json(version / "qa_quarantine.jsonl", lines=True)
    assert len(quarantine) == 5 and set(quarantine["data_source"]) == {"qampari"}
    # the truncated QAMPARI line: reason invalid_json, its raw text kept (read back through the catalog)
    cut = quarantine.set_index("id").loc["qampari:line5"]
    assert cut["reasons"] == "invalid_json"
    assert cut["record"] == (FIXTURES / "qampari.jsonl").read_text().splitlines()[4]

    (report,) = list((kedro_project / "data/08_reporting/data_quality_report.md").iterdir())
    text = (report / "data_quality_report.md").read_text()
    assert "| qampari | 6 | 1 | 5 | 83.3% |" in text and "**duplicate_id** (1): `qampari:q-films`" in text

    run = _runs()[0]
    assert run.info.status == "FAILED"
    assert "DataQualityError" in run.data.tags["error"]
    assert run.data.metrics["data_prep/qampari/rows_quarantined"] == 5
