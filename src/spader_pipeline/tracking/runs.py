"""MLflow run logging: the runs of a ``kedro run`` and what nodes, trainers and plugins log into them.

Every ``kedro run`` is one MLflow run, the *chain* run, opened by
:class:`spader_pipeline.hooks.MlflowTrackingHooks` and named for what ran (:func:`chain_run_name`).
Each training run of a method is a run of its own (:func:`method_run`), and so is each evaluation:
top-level runs linked to their chain run by the tags :data:`CHAIN_RUN_TAG` and :data:`CHAIN_TAG`
(:func:`linked_run`), so the runs table lists them without expanding anything and GRPO and SPADER
runs can be ticked and compared, with the same metric keys for every method. A method's pipeline
run alone makes its ``kedro run`` run the method run. Evaluations of a trained checkpoint carry
:func:`training_link_tags` and copy their headline scores onto the training run
(:func:`log_heldout`), so Compare shows held-out results next to the training curves.

A grid of cells run on Ray (:mod:`spader_pipeline.grid`) is one run too, the *grid* run: its driver
opens it (:func:`grid_run_name`) and hands its id to the grid's jobs in :data:`GRID_RUN_ENV`; each
job's chain run is its child (``mlflow.parentRunId``), so the experiment page folds the grid under it.

Code that runs inside a node logs into the active run through the functions here, which are no-ops
when no run is active (plain unit tests, library use). Code in another process (a verl worker) logs
into the run its parent handed over (:func:`handed_over_run`, :func:`log_metrics_to_run`). Metric
keys use ``/`` namespaces (``data_prep/rows_in``); every key is documented in ``docs/metrics.md``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import mlflow

logger = logging.getLogger(__name__)

#: Kedro node tag: the node is one training run of a method, tracked as a run of its own.
METHOD_RUN_TAG = "mlflow_method_run"
#: Run tag the hook sets when the ``kedro run`` run is itself the method run (pipeline run alone).
ADOPT_TAG = "spader.method_run_pending"
#: Tags of a method or evaluation run: the id and name of the ``kedro run`` (chain) run it belongs to.
CHAIN_RUN_TAG = "chain_run_id"
CHAIN_TAG = "chain"
#: Tags copied from the chain run onto its linked runs (who ran what, from which source and commit).
_INHERITED_TAGS = ("mlflow.user", "mlflow.source.name", "mlflow.source.type", "git.commit", "kedro.env",
                   "kedro.session_id")
#: Training metrics that mean the same for every method, in the order a comparison reads them; the
#: keys under ``method_reward/`` depend on each method's reward terms (docs/metrics.md).
COMPARABLE_FIRST = ("answer/recall", "answer/f1", "retrieval/recall")
METHOD_DEPENDENT_PREFIX = "method_reward/"
#: Environment variable of a grid's jobs: the id of the grid run their chain runs nest under.
GRID_RUN_ENV = "SPADER_GRID_RUN_ID"
#: Tag of a grid run (``"true"``) and of its jobs' runs (the job: ``shared part`` or the cell's name).
GRID_TAG = "spader.grid"
GRID_JOB_TAG = "grid.job"
#: Evaluation scores copied onto the training run as ``heldout/<dataset>/<key>`` (docs/metrics.md).
HELDOUT_KEYS = ("recall", "precision", "f1", "exact_match", "seen_recall", "failure_rate")


def flatten(mapping: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Flatten nested mappings: ``{"a": {"b": 1}}`` → ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name, sep))
        else:
            flat[name] = value
    return flat


def numeric_items(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric leaves of a (nested) mapping, keys joined with ``/``."""
    out: dict[str, float] = {}
    for key, value in flatten(mapping, prefix, sep="/").items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, int | float) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def active() -> bool:
    return mlflow.active_run() is not None


def comparable_first(values: Mapping[str, float]) -> dict[str, float]:
    """``values`` with :data:`COMPARABLE_FIRST` leading and ``method_reward/*`` last, else in order.

    MLflow lists a run's metrics in the order they were first logged, and its Compare view plots
    the first listed metric; a comparable one belongs there, not a method's own return.
    """
    def rank(key: str) -> int:
        if key in COMPARABLE_FIRST:
            return COMPARABLE_FIRST.index(key)
        return len(COMPARABLE_FIRST) + (1 if key.startswith(METHOD_DEPENDENT_PREFIX) else 0)

    return dict(sorted(values.items(), key=lambda item: rank(item[0])))


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "", *,
                model_id: str | None = None) -> None:
    """Log the numeric leaves of ``metrics`` to the active run (no-op without one), comparable
    metrics first (:func:`comparable_first`); with ``model_id`` also against that MLflow model."""
    if not active():
        return
    values = comparable_first(numeric_items(metrics, prefix))
    if values:
        mlflow.log_metrics(values, step=step, model_id=model_id)


def log_params(params: Mapping[str, Any], prefix: str = "") -> None:
    """Log flattened parameters to the active run; values are truncated to MLflow's limit."""
    if not active():
        return
    flat = {k: str(v)[:6000] for k, v in flatten(params, prefix).items()}
    items = list(flat.items())
    for start in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        mlflow.log_params(dict(items[start : start + 100]))


def log_artifact(path: str | Path, artifact_path: str | None = None) -> None:
    """Log a file or folder as an artifact of the active run (no-op without one)."""
    if not active():
        return
    path = Path(path)
    if path.is_dir():
        mlflow.log_artifacts(str(path), artifact_path)
    elif path.exists():
        mlflow.log_artifact(str(path), artifact_path)


def log_text(text: str, artifact_file: str) -> None:
    """Save ``text`` as the artifact ``artifact_file`` of the active run (no-op without one)."""
    if active():
        mlflow.log_text(text, artifact_file)


def log_figure(figure: Any, artifact_file: str) -> None:
    """Save a matplotlib ``figure`` as the artifact ``artifact_file`` of the active run (no-op without one)."""
    if active():
        mlflow.log_figure(figure, artifact_file)


def active_run_id() -> str | None:
    """The id of the active run (``None`` without one)."""
    run = mlflow.active_run()
    return run.info.run_id if run is not None else None


def handed_over_run() -> tuple[str | None, str | None]:
    """``(run id, tracking URI)`` of the run this process logs into: the one a parent process handed
    over in ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` (a verl worker), else the active run (URI
    ``None``: the current one); ``(None, None)`` without either."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        return run_id, os.environ.get("MLFLOW_TRACKING_URI")
    return active_run_id(), None


def log_metrics_to_run(run_id: str, metrics: Mapping[str, float], step: int | None,
                       tracking_uri: str | None = None) -> bool:
    """Log the flat ``metrics`` at ``step`` to the run ``run_id`` (active or not) in one request,
    stamped now; ``True`` when the store took them. A store that fails is warned about, never
    raised: a lost metric must not stop a training run."""
    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    entries = [Metric(key, float(value), timestamp, int(step or 0)) for key, value in metrics.items()]
    try:
        mlflow.MlflowClient(tracking_uri=tracking_uri).log_batch(run_id, metrics=entries)
    except mlflow.exceptions.MlflowException as exc:
        logger.warning("step %s: metrics not logged to MLflow run %s: %s", step, run_id, exc)
        return False
    return True


def run_url(run_id: str, experiment_id: str) -> str:
    """The run's page, relative to the MLflow UI root (a link in run descriptions)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}"


def chain_run_name(pipeline: str, env: str, when: datetime | None = None, part: str | None = None) -> str:
    """The chain run's name: what ran, in which Kedro environment, when (local time, to the minute).

    ``chain_run_name("__default__", "local")`` → ``"full chain · env local · 2026-11-24 21:40"``;
    a named pipeline gives ``"pipeline evaluate · env local · …"``, a part of one (a grid's job)
    ``"shared part of compare · env compare · …"``. What ran comes first: the runs table cuts long names.
    """
    what = "full chain" if pipeline in ("", "__default__") else f"pipeline {pipeline}"
    if part:
        what = f"{part} of {'the full chain' if what == 'full chain' else pipeline}"
    return f"{what} · env {env} · {(when or datetime.now()).strftime('%Y-%m-%d %H:%M')}"


def grid_run_name(pipeline: str, env: str, when: datetime | None = None) -> str:
    """The grid run's name: ``"compare grid · env compare · 2026-11-28 21:40"``."""
    return f"{pipeline} grid · env {env} · {(when or datetime.now()).strftime('%Y-%m-%d %H:%M')}"


def grid_parent() -> str | None:
    """The grid run this process's chain run nests under (:data:`GRID_RUN_ENV`), if any."""
    return os.environ.get(GRID_RUN_ENV) or None


def end_unfinished_children(parent_run_id: str, status: str = "KILLED") -> list[str]:
    """End the children of ``parent_run_id`` still marked running with ``status``; return their names.

    A grid's job whose process was killed (its Ray worker died, and Ray ran it again) never ended its
    run; once the grid's jobs are over, none of its runs is running. Their metrics stay."""
    client = mlflow.MlflowClient()
    parent = client.get_run(parent_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' "
                                                "and attributes.status = 'RUNNING'")
    for child in children:
        client.set_terminated(child.info.run_id, status)
    return [child.info.run_name for child in children]


@contextmanager
def linked_run(name: str, tags: Mapping[str, Any]) -> Iterator[str]:
    """A top-level run linked to the active (chain) run by tags, active for the body; yields its id.

    Not nested (no ``mlflow.parentRunId``): the runs table shows it without expanding the chain run;
    ``tags.chain_run_id = '<id>'`` in the UI's search box lists a chain's runs. The active run must
    exist; when it is itself a linked run, the new run joins the same chain. The run ends
    ``FINISHED``, or ``FAILED`` with the error as a tag when the body raises.
    """
    active_run = mlflow.active_run()
    if active_run is None:
        raise RuntimeError("linked_run needs an active MLflow run (the chain run)")
    client = mlflow.MlflowClient()
    chain = client.get_run(active_run.info.run_id)
    inherited = {k: v for k, v in chain.data.tags.items() if k in _INHERITED_TAGS}
    link = {CHAIN_RUN_TAG: chain.data.tags.get(CHAIN_RUN_TAG, chain.info.run_id),
            CHAIN_TAG: chain.data.tags.get(CHAIN_TAG, chain.info.run_name)}
    all_tags = {**inherited, **link, **{k: str(v) for k, v in tags.items() if v is not None}}
    created = client.create_run(chain.info.experiment_id, run_name=name, tags=all_tags)
    # Activating an existing run by id keeps the fluent run stack (the chain run is active again
    # after it ends) without the parent tag that nesting would add.
    run = mlflow.start_run(run_id=created.info.run_id, nested=True)
    try:
        yield run.info.run_id
    except BaseException as error:
        mlflow.set_tag("error", f"{type(error).__name__}: {error}"[:5000])
        mlflow.end_run(status="FAILED")
        raise
    mlflow.end_run(status="FINISHED")


@contextmanager
def method_run(name: str, tags: Mapping[str, Any], params: Mapping[str, Any]) -> Iterator[str | None]:
    """The MLflow run of one training run of a method; yields its id (``None`` without tracking).

    A run linked to the active (chain) run (:func:`linked_run`), or — when the hook marked the
    active run as this pipeline's method run (the method's pipeline ran alone) — that run itself,
    renamed and tagged. Without an active run nothing is logged. ``params`` are flattened with
    ``.``; the run ends ``FINISHED``, or ``FAILED`` with the error as a tag when the body raises.
    """
    parent = mlflow.active_run()
    if parent is None:
        yield None
        return
    tags = {k: str(v) for k, v in tags.items() if v is not None}
    if mlflow.get_run(parent.info.run_id).data.tags.get(ADOPT_TAG) == "true":
        client = mlflow.MlflowClient()
        client.delete_tag(parent.info.run_id, ADOPT_TAG)
        mlflow.set_tags({**tags, "mlflow.runName": name})
        log_params(params)
        yield parent.info.run_id  # the hook ends it with the kedro run
        return
    with linked_run(name, tags) as run_id:
        log_params(params)
        yield run_id


def log_heldout(training_run_id: str | None, dataset: str, metrics: Mapping[str, Any]) -> None:
    """Copy an evaluation's headline scores onto the training run of its checkpoint.

    Logged as ``heldout/<dataset>/<key>`` for :data:`HELDOUT_KEYS`, so MLflow's Compare view of
    two training runs lists their held-out results side by side. A training run that is not in
    this tracking store (a checkpoint trained elsewhere) is skipped.
    """
    if not training_run_id or not active():
        return
    values = {f"heldout/{dataset}/{k}": v for k, v in numeric_items(metrics).items() if k in HELDOUT_KEYS}
    if not values:
        return
    client = mlflow.MlflowClient()
    try:
        client.get_run(training_run_id)
    except mlflow.exceptions.MlflowException:
        logger.info("training run %s not in this tracking store; held-out scores not copied", training_run_id)
        return
    for key, value in values.items():
        client.log_metric(training_run_id, key, value)


def register_checkpoint(
    path: str | Path, *, name: str, params: Mapping[str, Any] | None = None, run_id: str | None = None
) -> str | None:
    """Record a trained checkpoint as an MLflow model of its training run; return the model id.

    ``run_id``: the training run (default: the active run). Nothing is recorded while no run is
    active (tracking off). The weights stay where they are (multi-GB checkpoints are not copied
    into the artifact store): the model is an *external* MLflow model whose source run is the
    training run and whose tag ``checkpoint.path`` points at the folder. Evaluations log their
    metrics against this model id, so the model page lists how it scored, each score linking to
    its evaluation run.
    """
    if not active():
        return None
    run_id = run_id or active_run_id()
    client = mlflow.MlflowClient()
    folder = str(Path(path).resolve())
    model = mlflow.create_external_model(
        name=name,
        source_run_id=run_id,
        tags={"checkpoint.path": folder},
        params={k: str(v)[:6000] for k, v in flatten(params or {}).items()},
        model_type="checkpoint",
        experiment_id=client.get_run(run_id).info.experiment_id,
    )
    client.set_tag(run_id, "checkpoint.path", folder)
    client.set_tag(run_id, "checkpoint.model_id", model.model_id)
    return model.model_id


def model_in_store(model_id: str | None) -> str | None:
    """``model_id`` when that MLflow model is in this tracking store, else ``None``."""
    try:
        return mlflow.get_logged_model(model_id).model_id if model_id else None
    except mlflow.exceptions.MlflowException:
        return None


def training_note(link: Mapping[str, str]) -> str | None:
    """Markdown description of an evaluation run: which training run made the checkpoint (a link);
    ``link`` holds :func:`training_link_tags`. ``None`` without a training run."""
    run_id = link.get("training_run_id")
    if not run_id:
        return None
    try:
        run = mlflow.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return f"Checkpoint `{link.get('checkpoint.path')}` from training run `{run_id}` (not in this tracking store)."
    return f"Checkpoint `{link.get('checkpoint.path')}` trained in run [{run.info.run_name}]({run_url(run_id, run.info.experiment_id)})."


def training_link_tags(manifest: Mapping[str, Any]) -> dict[str, str]:
    """Tags that link an evaluation to the training run of its checkpoint (from a model manifest)."""
    out = {
        "method": manifest.get("method"),
        "training_run_id": manifest.get("mlflow_run_id"),
        "checkpoint.path": manifest.get("path"),
        "checkpoint.model_id": manifest.get("mlflow_model_id"),
    }
    return {k: str(v) for k, v in out.items() if v}
