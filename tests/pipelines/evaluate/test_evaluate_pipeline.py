"""A real ``kedro run --pipeline index_build,evaluate --env test`` on a small fixture, through
KedroSession: a retrieval server started and stopped by the node, the scripted policy and the
models of the catalog's manifests (base, warm start, trained methods), versioned outputs, nested
MLflow runs linked to their training runs, resume on rerun, a missing model is an error."""

from __future__ import annotations

import json
import re
import shutil

import mlflow
import pandas as pd
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline import tracking
from spader_pipeline.evaluation.models import ModelUnavailableError

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
    base = root / "data/06_models/base_model"
    build_base_model(texts, base, spec=spec, vocab_size=500, min_frequency=1)
    # the catalog's model manifests: the tiny model stands in for every checkpoint; the trained
    # methods' folders are wherever merge put them (not train_<m>/final), with their training run
    (root / "data/06_models/base_model_manifest.json").write_text(json.dumps({"path": str(base)}))
    (root / "data/06_models/warm_start_manifest.json").write_text(json.dumps({"path": str(base), "warm_start": False}))
    mlflow.set_experiment("spader-pipeline-test")
    for method in ("grpo", "spader"):
        merged = root / f"data/06_models/merged/train_{method}"
        shutil.copytree(base, merged)
        with mlflow.start_run(run_name=f"{method} seed0", tags={"method": method}) as run:
            model_id = tracking.register_checkpoint(merged, name=method)
        manifest = {"path": str(merged), "method": method, "backend": "verl", "merged": True,
                    "mlflow_run_id": run.info.run_id, "mlflow_model_id": model_id}
        (root / f"data/06_models/train_{method}").mkdir(parents=True)
        (root / f"data/06_models/train_{method}/model_manifest.json").write_text(json.dumps(manifest))


def _latest(path):
    return sorted(path.iterdir())[-1] / path.name


@pytest.mark.heavy
@pytest.mark.e2e
@pytest.mark.slow
def test_evaluate_session_run_scripted_and_catalog_models(kedro_project, caplog):
    _write_inputs(kedro_project)
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["index_build", "evaluate"])

    samples = pd.read_json(
        _latest(kedro_project / "data/07_model_output/eval_samples.jsonl"), lines=True, dtype={"id": str}
    )
    assert len(samples) == 20 and set(samples["status"]) == {"ok"}
    base = samples[samples["model"] == "base"]
    assert len(base) == 4 and (base["format_error"] == 1.0).all()  # untrained: never a valid answer
    samples = samples[samples["model"] == "scripted"]
    assert {"id", "question", "ground_truth", "data_source", "history", "predicted", "f1", "recall_at_5"} <= set(samples.columns)
    row = samples.set_index("id").loc["q1"]
    assert sorted(row["predicted"]) == sorted(GROUPS["Country in West Africa"])
    table = pd.read_csv(_latest(kedro_project / "data/08_reporting/eval_table.csv"))
    models = ["base", "warm_start", "grpo", "spader", "scripted"]  # the catalog's, then evaluate.models
    assert list(table[["model", "dataset"]].itertuples(index=False, name=None)) == [(m, "embedded_test") for m in models]
    scripted = table.set_index("model").loc["scripted"]
    assert scripted["f1"] == 1.0 and scripted["num_failed"] == 0
    assert _latest(kedro_project / "data/08_reporting/eval_comparison.png").stat().st_size > 1000
    assert "qwen3-8b-spader is disabled" in caplog.text  # switched off explicitly, not skipped silently

    # one chain run for the kedro run, one top-level run per evaluation linked to it by tags and to training
    runs = mlflow.search_runs(
        experiment_names=["spader-pipeline-test"], output_format="list", order_by=["start_time DESC"]
    )
    nested = [r for r in runs if r.info.run_name == "evaluate:scripted:embedded_test"][0]
    assert "mlflow.parentRunId" not in nested.data.tags  # listed without expanding the chain run
    parent = mlflow.get_run(nested.data.tags["chain_run_id"])
    assert parent.data.tags["kedro.pipeline"] == "index_build,evaluate"
    assert nested.data.tags["chain"] == parent.info.run_name and parent.info.run_name.startswith("pipeline index_build,evaluate · env test · ")
    assert parent.data.metrics["evaluation/scripted/embedded_test/f1"] == 1.0
    assert (nested.data.tags["model"], nested.data.tags["dataset"]) == ("scripted", "embedded_test")
    assert "method" not in nested.data.tags and "training_run_id" not in nested.data.tags
    assert nested.data.metrics["recall"] == 1.0
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(nested.info.run_id)}
    assert artifacts == {"plots", "samples"}
    spader_eval = [r for r in runs if r.info.run_name == "evaluate:spader:embedded_test"][0]
    training_run = mlflow.get_run(spader_eval.data.tags["training_run_id"])
    assert training_run.info.run_name == "spader seed0" and spader_eval.data.tags["method"] == "spader"
    assert spader_eval.data.tags["checkpoint.path"].endswith("merged/train_spader")
    assert f"runs/{training_run.info.run_id})" in spader_eval.data.tags["mlflow.note.content"]  # a link
    model = mlflow.get_logged_model(spader_eval.data.tags["checkpoint.model_id"])
    assert model.source_run_id == training_run.info.run_id
    assert {m.key for m in model.metrics if m.run_id == spader_eval.info.run_id} >= {"recall", "f1"}
    heldout = mlflow.get_run(training_run.info.run_id).data.metrics  # Compare shows it on the training run
    assert heldout["heldout/embedded_test/recall"] == spader_eval.data.metrics["recall"]
    assert {"heldout/embedded_test/f1", "heldout/embedded_test/seen_recall"} <= set(heldout)

    # rerun: every sample comes from the work files (resume), results identical; a checkpoint has one
    # work file per part (evaluate.runner.shards), and parts exist where two children run at once,
    # that is, where this process has two torch threads or more
    def done_per_model() -> dict[str, int]:
        lines: dict[str, int] = {}
        for work in (kedro_project / "data/07_model_output/eval_work").iterdir():
            model = work.name.split("__")[0]
            lines[model] = lines.get(model, 0) + len(work.read_text().splitlines())
        return lines

    assert done_per_model() == dict.fromkeys(models, 4)
    caplog.clear()
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["evaluate"])
    assert done_per_model() == dict.fromkeys(models, 4)
    resumed = re.findall(r"resuming, (\d+) of (\d+) samples already done", caplog.text)
    assert resumed and all(done == total for done, total in resumed)
    assert sum(int(done) for done, _ in resumed) == 4 * len(models)

    # a trained model that is missing is an error, not a skipped row
    shutil.rmtree(kedro_project / "data/06_models/merged/train_grpo")
    with pytest.raises(ModelUnavailableError, match="model grpo .*no Hugging Face checkpoint"):
        with KedroSession.create(project_path=kedro_project, env="test") as session:
            session.run(pipeline_names=["evaluate"])
