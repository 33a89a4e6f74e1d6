"""Nodes of ``make compare``: a seeded comparison of methods from one shared warm start.

The pipeline (:mod:`.pipeline`) is a fan-out: :func:`check_design` refuses a design that cannot
give a confidence interval before anything trains, :func:`select_heldout` fixes the held-out
questions, :func:`evaluate_references` scores the warm start and the reference models once, then
every method × seed is a namespace of its own (:func:`cell_settings` → the training stage's
``train_policy`` → ``merge_policy`` → :func:`evaluate_cell`), and :func:`gather_cells` and
:func:`write_report` turn every cell's per-question scores into the report (:mod:`spader_pipeline.reporting.compare`).
Resuming is Kedro's: ``kedro run --only-missing-outputs`` skips every node whose outputs exist.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.child_process import runs_child_processes
from spader_pipeline.data.schema import frame_records
from spader_pipeline.evaluation.suite import evaluate_manifests, records_frame
from spader_pipeline.pipelines.evaluate.nodes import count_entity_frequencies
from spader_pipeline.training import TrainingSettings
from spader_pipeline.typed_config import merge_settings

logger = logging.getLogger(__name__)

#: Label of a compare cell's MLflow run name and its ``chain_kind`` tag.
RUN_LABEL = "compare"


def cell_name(method: str, seed: int) -> str:
    """The namespace of one method × seed (``grpo_seed0``)."""
    return f"{method}_seed{int(seed)}"


def check_design(eval_sets: Mapping[str, Callable[[], pd.DataFrame]], compare: Mapping[str, Any],
                 cells: Sequence[tuple[str, int]] | None = None) -> dict[str, Any]:
    """The comparison's design, checked before any training: ≥ 2 seeds, two methods, a held-out set
    with at least ``min_questions`` questions, and — given the ``cells`` the pipeline registered
    from conf — the same methods × seeds. Returns methods, seeds, dataset and question ids."""
    methods, seeds = list(compare.get("methods") or []), list(compare.get("seeds") or [])
    if len(methods) != 2 or len(set(methods)) != 2:
        raise ValueError(f"compare.methods must name two different methods (baseline, candidate), got {methods}")
    if len(set(seeds)) < 2:
        raise ValueError(f"compare.seeds: a confidence interval over seeds needs at least 2 seeds, got {seeds}; "
                         "set e.g. compare.seeds=[0,1,2]")
    if cells is not None and sorted((m, int(s)) for m in methods for s in seeds) != sorted(cells):
        raise ValueError(f"compare.methods × compare.seeds ({methods} × {seeds}) differ from the pipeline's cells "
                         f"{sorted(cell_name(m, s) for m, s in cells)}: the cells are registered from the run's "
                         "parameters when Kedro loads the pipeline registry; set them in "
                         "conf/<env>/parameters_compare.yml and start the run in a new process")
    dataset = compare["dataset"]
    if dataset not in eval_sets:
        raise ValueError(f"compare.dataset {dataset!r} is not an evaluation set (have: {sorted(eval_sets)}); "
                         "the multi-search held-out split is embedded_test")
    rows = eval_sets[dataset]()
    if compare.get("max_questions"):
        rows = rows.head(int(compare["max_questions"]))
    minimum = int(compare.get("min_questions", 100))
    if len(rows) < minimum:
        raise ValueError(f"compare.dataset {dataset!r} has {len(rows)} questions; a paired interval needs at least "
                         f"{minimum} (compare.min_questions)")
    logger.info("compare: %s vs %s, seeds %s, %d held-out questions of %s", *methods, seeds, len(rows), dataset)
    return {"methods": methods, "seeds": [int(s) for s in seeds], "dataset": dataset,
            "question_ids": [str(i) for i in rows["id"]]}


def evaluation_settings(evaluate: Mapping[str, Any], compare_evaluation: Mapping[str, Any] | None,
                        dataset: str) -> dict[str, Any]:
    """``evaluate`` with ``compare.evaluation`` laid over it, on the held-out set alone."""
    return {**merge_settings(evaluate, compare_evaluation), "datasets": [dataset], "max_samples": None,
            "extra_files": {}, "catalog_overrides": {}}


def select_heldout(design: Mapping[str, Any], eval_sets: Mapping[str, Callable[[], pd.DataFrame]],
                   corpus: pd.DataFrame, evaluate: Mapping[str, Any],
                   compare_evaluation: Mapping[str, Any] | None) -> dict[str, Any]:
    """The design's held-out questions (records) and their gold entities' corpus frequencies."""
    dataset, keep = design["dataset"], set(design["question_ids"])
    selected = {dataset: [r for r in frame_records(eval_sets[dataset]()) if str(r["id"]) in keep]}
    params = evaluation_settings(evaluate, compare_evaluation, dataset)
    return {"dataset": dataset, "records": selected[dataset],
            "frequencies": count_entity_frequencies(selected, corpus, params).get(dataset, {})}


def _evaluate(heldout: Mapping[str, Any], index_manifest: Mapping[str, Any], params: Mapping[str, Any],
              prompt: Mapping[str, Any], manifests: Mapping[str, Mapping[str, Any]], on_result=None):
    dataset = heldout["dataset"]
    frequencies = {dataset: heldout["frequencies"]} if heldout.get("frequencies") else {}
    return evaluate_manifests(params, manifests, {dataset: list(heldout["records"])}, frequencies,
                              index_manifest=index_manifest, prompt=prompt, on_result=on_result)


@runs_child_processes
def evaluate_references(warm_start_manifest: Mapping[str, Any], heldout: Mapping[str, Any],
                        index_manifest: Mapping[str, Any], evaluate: Mapping[str, Any],
                        compare_evaluation: Mapping[str, Any] | None, prompt: Mapping[str, Any]
                        ) -> tuple[pd.DataFrame, dict[str, float]]:
    """The warm start and ``compare.evaluation.models`` (e.g. scripted), greedy, once: per-question
    records (``method`` = model, ``seed`` = -1) and headline scores (``<model>/<metric>``)."""
    params = evaluation_settings(evaluate, compare_evaluation, heldout["dataset"])
    results = _evaluate(heldout, index_manifest, params, prompt, {"warm_start": warm_start_manifest})
    samples = records_frame(results)
    metrics = {f"{r.model.name}/{k}": v for r in results for k, v in tracking.numeric_items(r.metrics).items()
               if k in tracking.HELDOUT_KEYS}
    return samples.assign(method=samples["model"], seed=-1), metrics


def cell_settings(training: Mapping[str, Any], merge: Mapping[str, Any], output_dir: str,
                  seed: int) -> tuple[TrainingSettings, dict[str, Any]]:
    """The typed ``training`` settings and the ``merge`` settings of one cell: its seed and its own
    directories."""
    seeded = seed_training(TrainingSettings.from_mapping(training), output_dir, seed)
    return (seeded.with_changes(run_label=RUN_LABEL),
            {**merge, "output_dir": str(Path(seeded.output_dir) / "merged")})


def seed_training(training: TrainingSettings, output_dir: str, seed: int) -> TrainingSettings:
    """``training`` for one seed: its own output directory and the RL seed (both backends)."""
    seed = int(seed)
    return training.with_changes(output_dir=str(Path(output_dir) / f"seed{seed}"), native={"seed": seed},
                                 verl_overrides=(f"data.seed={seed}", f"actor_rollout_ref.actor.data_loader_seed={seed}"))


@runs_child_processes
def evaluate_cell(model_manifest: Mapping[str, Any], heldout: Mapping[str, Any], index_manifest: Mapping[str, Any],
                  evaluate: Mapping[str, Any], compare_evaluation: Mapping[str, Any] | None,
                  prompt: Mapping[str, Any], method: str, seed: int) -> pd.DataFrame:
    """One cell's trained policy, greedy on the held-out questions: its per-question records; the
    headline scores also go onto the cell's training run (``heldout/<dataset>/…``)."""
    params = {**evaluation_settings(evaluate, compare_evaluation, heldout["dataset"]), "models": []}
    run_id = model_manifest.get("mlflow_run_id")
    results = _evaluate(heldout, index_manifest, params, prompt, {cell_name(method, seed): model_manifest},
                        on_result=lambda r: tracking.log_heldout(run_id, r.dataset, r.metrics))
    return records_frame(results).assign(method=method, seed=int(seed))


def gather_cells(design: Mapping[str, Any], reference_samples: pd.DataFrame,
                 **cells: Any) -> tuple[dict[str, Any], pd.DataFrame]:
    """Every cell's per-step history and per-question records (inputs ``<cell>__history`` and
    ``<cell>__samples``) with the references': the runs and the samples the report reads."""
    runs: dict[str, Any] = {}
    frames = [reference_samples]
    for seed in design["seeds"]:
        for method in design["methods"]:
            name = cell_name(method, seed)
            runs[name] = {"method": method, "seed": int(seed), "history": cells[f"{name}__history"]}
            frames.append(cells[f"{name}__samples"])
    return runs, pd.concat(frames, ignore_index=True)


def write_report(design: Mapping[str, Any], runs: Mapping[str, Any], samples: pd.DataFrame,
                 compare: Mapping[str, Any], training: Mapping[str, Any]) -> tuple[str, Any, dict[str, float]]:
    """The comparison report (markdown, figure, metrics); markdown and figure also go to the MLflow
    chain run's artifacts (the project hook logs the metrics as ``compare/...``)."""
    from spader_pipeline.reporting.compare import build_report

    text, figure, metrics = build_report(design, runs, samples, compare, TrainingSettings.from_mapping(training).trainer)
    tracking.log_text(text, "compare/report.md")
    tracking.log_figure(figure, "compare/curves.png")
    return text, figure, metrics
