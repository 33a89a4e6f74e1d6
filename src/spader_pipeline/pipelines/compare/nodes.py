"""Nodes of ``make compare``: a seeded comparison of two methods from one shared warm start.

:func:`check_design` refuses a design that cannot give a confidence interval before anything
trains; :func:`train_and_evaluate` trains every method × seed (the training stage's
``train_policy``, one MLflow run ``<method> seed<k>`` each) and evaluates each policy greedy on the
held-out set (the evaluate stage's ``run_evaluations``); :mod:`.report` turns the per-question
scores into the table, the curves and the paired difference.

Interrupted, a rerun resumes: the warm start is reused (``warm_start.reuse``), a finished
method × seed is not trained again (a marker with its settings' fingerprint beside its checkpoints),
an unfinished one resumes from its last checkpoint, and evaluation skips the questions already
answered (``evaluate.runner.resume``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from spader_pipeline.pipelines.evaluate.nodes import count_entity_frequencies, run_evaluations
from spader_pipeline.pipelines.training.nodes import train_policy, warm_start

logger = logging.getLogger(__name__)

RUN_DONE = "compare_done.json"
"""Marker of a finished method × seed training: fingerprint, manifest and per-step history."""


def check_design(eval_sets: Mapping[str, Callable[[], pd.DataFrame]], compare: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison's design, checked before any training: ≥ 2 seeds, two methods, a held-out set
    with at least ``min_questions`` questions. Returns methods, seeds, dataset and question ids."""
    methods, seeds = list(compare.get("methods") or []), list(compare.get("seeds") or [])
    if len(methods) != 2 or len(set(methods)) != 2:
        raise ValueError(f"compare.methods must name two different methods (baseline, candidate), got {methods}")
    if len(set(seeds)) < 2:
        raise ValueError(f"compare.seeds: a confidence interval over seeds needs at least 2 seeds, got {seeds}; "
                         "set e.g. compare.seeds=[0,1,2]")
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


def shared_warm_start(design: Mapping[str, Any], *args: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """The training stage's warm start, ordered after :func:`check_design` (``design`` is unused)."""
    return warm_start(*args)


def seed_training(training: Mapping[str, Any], output_dir: str, seed: int) -> dict[str, Any]:
    """``training`` for one seed: its own output directory and the RL seed (both backends)."""
    native = {**(training.get("native") or {}), "seed": int(seed)}
    verl = dict(training.get("verl") or {})
    verl["overrides"] = [*(verl.get("overrides") or []), f"data.seed={int(seed)}", f"actor_rollout_ref.actor.data_loader_seed={int(seed)}"]
    return {**training, "output_dir": str(Path(output_dir) / f"seed{seed}"), "native": native, "verl": verl}


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _train_once(init: Mapping[str, Any], verl_train: pd.DataFrame, index_manifest: Mapping[str, Any],
                method: Mapping[str, Any], training: Mapping[str, Any], prompt: Mapping[str, Any],
                verl_validation: pd.DataFrame | None = None) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Train one method × seed, or return the finished one recorded in its run directory."""
    run_dir = Path(training["output_dir"]) / f"train_{method['method']}"
    marker = run_dir / RUN_DONE
    fingerprint = _fingerprint(init.get("path"), method, {k: v for k, v in training.items() if k != "verl"}, prompt)
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("fingerprint") == fingerprint:
            logger.info("compare: %s already trained with these settings; reused", run_dir)
            return done["manifest"], done["history"]
    manifest, history, _ = train_policy(init, verl_train, index_manifest, method, training, prompt, verl_validation)
    if training.get("backend", "native") == "verl":
        from spader_pipeline.pipelines.merge.nodes import merge_policy

        manifest = {**merge_policy(manifest, {"output_dir": str(run_dir / "merged")}), "mlflow_run_id": manifest.get("mlflow_run_id")}
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"fingerprint": fingerprint, "manifest": manifest, "history": history}, default=str))
    return manifest, history


def train_and_evaluate(
    design: Mapping[str, Any],
    warm_start_manifest: Mapping[str, Any],
    verl_train: pd.DataFrame,
    index_manifest: Mapping[str, Any],
    eval_sets: Mapping[str, Callable[[], pd.DataFrame]],
    corpus: pd.DataFrame,
    parameters: Mapping[str, Any],
    verl_validation: pd.DataFrame | None = None,
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Every method × seed of ``design``: train from the shared warm start (validated on
    ``verl_validation`` during training), evaluate greedy on the test questions.

    Returns the runs (per method and seed: manifest and per-step history) and the per-question
    records of every evaluated model (columns ``model``, ``method``, ``seed`` added; the warm start
    is evaluated once, as ``method = warm_start``).
    """
    compare, training, prompt = parameters["compare"], parameters["training"], parameters["prompt"]
    evaluate = {**_merged(parameters["evaluate"], compare.get("evaluation") or {}), "datasets": [design["dataset"]],
                "max_samples": None, "extra_files": {}, "catalog_overrides": {}}
    trained_only = {**evaluate, "models": []}  # the reference models are evaluated once, beside the warm start
    keep = set(design["question_ids"])
    selected = {design["dataset"]: [r for r in _records(eval_sets[design["dataset"]]()) if str(r["id"]) in keep]}
    frequencies = count_entity_frequencies(selected, corpus, evaluate)

    def evaluate_model(name: str, manifest: Mapping[str, Any], params: Mapping[str, Any]) -> pd.DataFrame:
        samples, _, _ = run_evaluations(selected, frequencies, index_manifest, params, prompt, **{name: manifest})
        return samples

    first = evaluate_model("warm_start", warm_start_manifest, evaluate)
    frames = [first.assign(method=first["model"], seed=-1)]
    runs: dict[str, Any] = {}
    for seed in design["seeds"]:
        seeded = seed_training(training, compare["output_dir"], seed)
        for name in design["methods"]:
            block = parameters.get(f"train_{name}", {}).get("method")
            if block is None:
                raise ValueError(f"no train_{name}.method block in the parameters (methods: {design['methods']})")
            manifest, history = _train_once(warm_start_manifest, verl_train, index_manifest, block, seeded, prompt,
                                            verl_validation)
            runs[f"{name}_seed{seed}"] = {"method": name, "seed": seed, "manifest": manifest, "history": history}
            frames.append(evaluate_model(f"{name}_seed{seed}", manifest, trained_only).assign(method=name, seed=seed))
    return runs, pd.concat(frames, ignore_index=True)


def _merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` merged in, mappings key by key (lists and values replaced)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    from spader_pipeline.data.schema import sample_record

    return [sample_record(row) for row in frame.to_dict(orient="records")]


def write_report(design: Mapping[str, Any], runs: Mapping[str, Any], samples: pd.DataFrame,
                 compare: Mapping[str, Any], training: Mapping[str, Any]) -> tuple[str, Any, dict[str, float]]:
    """The comparison report (markdown, figure, metrics); markdown and figure also go to the MLflow
    chain run's artifacts (the project hook logs the metrics as ``compare/...``)."""
    from spader_pipeline import tracking

    from .report import build_report

    text, figure, metrics = build_report(design, runs, samples, compare, training)
    if tracking.active():
        import mlflow

        mlflow.log_text(text, "compare/report.md")
        mlflow.log_figure(figure, "compare/curves.png")
    return text, figure, metrics
