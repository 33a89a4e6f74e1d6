"""The analysis notebook: committed valid and stripped, and every cell runs on a tiny run's artefacts.

The artefacts are written the way a ``kedro run`` writes them: the evaluation table and samples
through the project's Kedro catalog, and the training metrics into MLflow method runs nested in a
``kedro run`` run (:func:`spader_pipeline.tracking.method_run`, the same keys the native trainer
logs). The notebook's code cells are then executed in order in one namespace, from the project root.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import mlflow
import nbformat
import pandas as pd

from spader_pipeline import tracking

NOTEBOOK = Path(__file__).resolve().parents[3] / "notebooks" / "training_report.ipynb"
METHODS = ("grpo", "spader")


def test_notebook_is_valid_and_stripped():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def _tiny_run(project: Path) -> None:
    from kedro.framework.session import KedroSession

    models = ["warm_start", *METHODS]
    table = pd.DataFrame([
        {"model": m, "dataset": "embedded_test", "num_samples": 2, "num_failed": 0, "recall": 0.1 * i,
         "precision": 0.2, "f1": 0.1, "seen_recall": 0.3, "long_tail_recall/1": 0.0}
        for i, m in enumerate(models)
    ])
    samples = pd.DataFrame([
        {"id": f"q{k}", "model": m, "dataset": "embedded_test", "status": "ok", "recall": 0.5, "f1": 0.4,
         "seen_recall": 0.5, "num_searches": 1, "question": "Which?", "prediction": ["Ghana"]}
        for m in models for k in range(2)
    ])
    with KedroSession.create(project_path=project) as session:
        catalog = session.load_context().catalog
        catalog.save("eval_table", table)
        catalog.save("eval_samples", samples)
    mlflow.set_experiment("spader-pipeline")
    with mlflow.start_run(run_name=tracking.chain_run_name("__default__", "local")):
        for slope, method in enumerate(METHODS, start=1):
            with tracking.method_run(f"{method} seed0", {"method": method, "backend": "native", "seed": 0},
                                     {"method": method}) as run_id:
                for step in range(1, 4):
                    tracking.log_metrics({"method_reward/mean": slope * step, "answer/f1": 0.1 * step,
                                          "answer/recall": 0.2, "retrieval/recall": 0.3,
                                          "adv/zero_groups": 0.5}, step=step)
            with tracking.linked_run(f"evaluate:{method}:embedded_test", {"method": method, "training_run_id": run_id}):
                tracking.log_metrics({"recall": 0.5})  # newer than the training run, and also tagged `method`


def test_notebook_runs_on_a_tiny_run(kedro_project, monkeypatch):
    matplotlib.use("Agg")
    _tiny_run(kedro_project)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    namespace: dict = {"__name__": "__main__"}
    for number, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        exec(compile(cell.source, f"{NOTEBOOK.name}[code cell {number}]", "exec"), namespace)  # noqa: S102
    assert len(namespace["table"]) == 3
    # the training runs, not the (newer) evaluation runs of their checkpoints
    assert {mlflow.get_run(r).info.run_name for r in namespace["run_ids"].values()} == {f"{m} seed0" for m in METHODS}
