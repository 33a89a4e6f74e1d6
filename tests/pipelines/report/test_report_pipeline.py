"""The report pipeline through KedroSession on synthetic evaluation rows and training histories."""

from __future__ import annotations

import math

import mlflow
import numpy as np
import pandas as pd
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline.pipelines.report.nodes import build_report
from spader_pipeline.reporting.training import smooth


def _eval_table():
    rows = []
    for model, r in (("warm_start", 0.05), ("grpo", 0.06), ("spader", 0.09)):
        rows.append({"model": model, "dataset": "embedded_test", "num_samples": 50, "num_failed": 0, "recall": r,
                     "precision": r * 2, "f1": r * 1.3, "seen_recall": r * 4, "long_tail_recall/1": math.nan,
                     "long_tail_recall/2-4": r / 2, "exact_match": 0.0})
    return pd.DataFrame(rows)


def _history(slope):
    return [{"step": s, "method_reward/mean": slope * s, "answer/f1": 0.01 * s, "answer/recall": 0.02, "retrieval/recall": 0.2,
             "perf/step_seconds": 3.0, "adv/zero_groups": 0.5, "adv/corr_vs_grpo": 1.0 - slope * 10,
             "group/distinct_query_seqs": 3.0} for s in range(1, 31)]


def test_smooth_is_a_trailing_mean():
    assert np.allclose(smooth([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])


def test_build_report_compares_models_and_methods():
    curves, final, markdown, metrics = build_report(
        _eval_table(), {"demonstrations": 100.0}, {"smoothing_window": 5, "models": ["warm_start", "grpo", "spader"]},
        history_grpo=_history(0.01), history_spader=_history(0.02),
    )
    assert len(curves.axes) == 10 and final.axes
    assert "| spader | embedded_test | 50 | 0 | 0.090 |" in markdown and "–" in markdown
    assert metrics["spader/embedded_test/seen_recall"] == pytest.approx(0.36)
    assert "grpo/embedded_test/long_tail_recall/1" not in metrics  # NaN buckets are left out
    assert metrics["spader/method_reward/mean_last"] == pytest.approx(0.02 * 28) and metrics["spader/window"] == 5
    assert metrics["grpo/steps"] == 30
    # comparable metrics lead; the method's own return follows, labelled as such; then the mechanism
    titles = [ax.get_title() for ax in curves.axes][2:]  # after the validation row
    assert titles[0] == "answer recall" and "not comparable" in titles[3]
    assert "correlation with GRPO" in titles[4] and "advantage 0" in titles[5] and "search sequences" in titles[6]
    # whether the updates differ: the mean agreement with GRPO per method
    assert metrics["spader/adv/corr_vs_grpo_mean"] == pytest.approx(0.8)
    assert metrics["grpo/adv/corr_vs_grpo_mean"] == pytest.approx(0.9)
    lead = markdown.split("| model |")[0]
    assert "`answer/*`" in lead and "`method_reward/*`" in lead and "docs/metrics.md" in lead
    summary_header = markdown.split("| method |")[1].split("\n")[0]
    assert summary_header.index("answer/recall first") < summary_header.index("method_reward/mean first")


def test_short_runs_compare_first_and_last_halves_and_empty_buckets_get_no_bars():
    _, final, _, metrics = build_report(
        _eval_table(), {}, {"smoothing_window": 10}, history_grpo=_history(0.01)[:3], history_spader=_history(0.02)[:2],
    )
    assert metrics["spader/window"] == 1 and metrics["spader/method_reward/mean_first"] == pytest.approx(0.02)
    assert metrics["spader/method_reward/mean_last"] == pytest.approx(0.04)
    assert metrics["grpo/window"] == 1 and metrics["grpo/method_reward/mean_last"] == pytest.approx(0.03)
    labels = [t.get_text() for t in final.axes[0].get_xticklabels()]
    assert "tail 1" not in labels and "tail 2-4" in labels  # long_tail_recall/1 is NaN for every model


def test_an_undefined_correlation_is_said_in_its_panel():
    # GRPO's advantages all 0 on SPADER's batches (every group tied): the correlation is NaN there.
    spader = [{**row, "adv/corr_vs_grpo": math.nan} for row in _history(0.02)[:2]]
    curves, *_ = build_report(_eval_table(), {}, {}, history_grpo=_history(0.01)[:2], history_spader=spader)
    panel = curves.axes[2 + 4]
    notes = " ".join(t.get_text() for t in panel.texts)
    assert "GRPO's advantages are all 0" in notes and "spader: steps 1, 2" in notes and "grpo" not in notes
    assert "lines join the steps" in curves._suptitle.get_text()


@pytest.mark.e2e
def test_report_session_run_writes_reporting_files_and_mlflow_artifacts(kedro_project):
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        catalog = session.load_context().catalog
        catalog.save("eval_table", _eval_table())
        catalog.save("warm_start_metrics", {"demonstrations": 10.0})
        catalog.save("train_grpo.training_history", _history(0.01))
        catalog.save("train_spader.training_history", _history(0.02))
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["report"])
    report = (kedro_project / "data/08_reporting/report.md").read_text()
    assert "GRPO vs SPADER" in report or "SPADER" in report
    assert list((kedro_project / "data/08_reporting/report_training_curves.png").iterdir())
    run = mlflow.search_runs(experiment_names=["spader-pipeline-test"], output_format="list",
                             order_by=["start_time DESC"])[0]
    assert run.data.metrics["report/spader/embedded_test/recall"] == pytest.approx(0.09)
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "report")}
    assert names == {"report/training_curves.png", "report/final_comparison.png", "report/report.md"}


def test_validation_curves_lead_with_the_warm_start_as_reference_and_step_0_is_no_training_step():
    def with_validation(history, values):
        val = {0: values[0], 2: values[1]}
        rows = [{"step": 0, "val/embedded/recall": values[0], "val/embedded/searches": 3.0}]
        return rows + [{**h, **({"val/embedded/recall": val[h["step"]], "val/embedded/searches": 3.5}
                                if h["step"] in val else {})} for h in history]

    curves, _, markdown, metrics = build_report(
        _eval_table(), {}, {"smoothing_window": 10},
        history_grpo=with_validation(_history(0.01)[:2], (0.20, 0.21)),
        history_spader=with_validation(_history(0.02)[:2], (0.20, 0.26)),
    )
    panel = curves.axes[0]
    assert "validation answer recall" in panel.get_title() and "embedded" in panel.get_title()
    reference = [line for line in panel.get_lines() if line.get_label().startswith("warm start (step 0)")]
    assert len(reference) == 1 and reference[0].get_ydata()[0] == pytest.approx(0.20)
    spader = next(line for line in panel.get_lines() if line.get_label() == "spader")
    assert list(spader.get_xdata()) == [0, 2] and list(spader.get_ydata()) == pytest.approx([0.20, 0.26])
    assert metrics["spader/steps"] == 2 and metrics["spader/window"] == 1  # step 0 is not a training step
    assert metrics["spader/val/embedded/recall_step_2"] == pytest.approx(0.26)
    assert metrics["grpo/val/embedded/recall_step_0"] == pytest.approx(0.20)
