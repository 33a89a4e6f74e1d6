"""MLflow helpers shared by the Kedro hook, nodes and trainers.

Every ``kedro run`` is one MLflow run, the *chain* run, opened by
:class:`spader_pipeline.hooks.MlflowTrackingHooks` and named for what ran (:func:`chain_run_name`).
Each training run of a method is a run of its own (:func:`method_run`), and so is each evaluation:
top-level runs linked to their chain run by the tags :data:`CHAIN_RUN_TAG` and :data:`CHAIN_TAG`
(:func:`linked_run`), so the runs table lists them without expanding anything and GRPO and SPADER
runs can be ticked and compared, with the same metric keys for every method. A method's pipeline
run alone makes its ``kedro run`` run the method run. Evaluations of a trained checkpoint carry
:func:`training_link_tags` and copy their headline scores onto the training run
(:func:`log_heldout`), so Compare shows held-out results next to the training curves.

Code that runs inside a node logs into the active run through the functions here, which are no-ops
when no run is active (plain unit tests, library use). Metric keys use ``/`` namespaces
(``data_prep/rows_in``); every key is documented in ``docs/metrics.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import mlflow

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
DEFAULT_ARTIFACT_DIR = "mlruns/artifacts"

#: The experiment tag that makes the MLflow UI open a training project in its model-training view
#: (runs table, metric charts) rather than the GenAI traces view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

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
#: Evaluation scores copied onto the training run as ``heldout/<dataset>/<key>`` (docs/metrics.md).
HELDOUT_KEYS = ("recall", "precision", "f1", "exact_match", "seen_recall", "failure_rate")


def resolve_tracking_uri(uri: str | None, project_path: Path) -> str:
    """Return an absolute tracking URI.

    ``MLFLOW_TRACKING_URI`` in the environment wins over ``uri`` (the configured value); a relative
    SQLite path is made absolute against ``project_path`` so that subprocesses (e.g. VERL) that join
    the run through ``MLFLOW_RUN_ID`` write into the same store.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or uri or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        db_path = (project_path / uri[len(prefix) :]).resolve()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        uri = prefix + str(db_path)
    elif uri.startswith(prefix + "/"):
        Path(uri[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
    return uri


def git_commit(project_path: Path) -> str:
    """The current git commit of the project (``"unknown"`` outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=project_path, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


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


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
    """Log the numeric leaves of ``metrics`` to the active run (no-op without one), comparable
    metrics first (:func:`comparable_first`)."""
    if not active():
        return
    values = comparable_first(numeric_items(metrics, prefix))
    if values:
        mlflow.log_metrics(values, step=step)


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


def ensure_experiment(name: str, artifact_location: Path | None = None) -> str:
    """Create (or find) the experiment ``name``, tagged as a model-training experiment; return its id.

    An existing experiment that lacks :data:`EXPERIMENT_KIND_TAG` (created by an older version, or by
    VERL's own tracker) gets it, so the UI opens it on the runs table.
    """
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        kwargs: dict[str, Any] = {"tags": {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}}
        if artifact_location is not None:
            artifact_location.mkdir(parents=True, exist_ok=True)
            kwargs["artifact_location"] = artifact_location.resolve().as_uri()
        return client.create_experiment(name, **kwargs)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


def active_run_id() -> str | None:
    """The id of the active run (``None`` without one)."""
    run = mlflow.active_run()
    return run.info.run_id if run is not None else None


def run_url(run_id: str, experiment_id: str) -> str:
    """The run's page, relative to the MLflow UI root (a link in run descriptions)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}"


def chain_run_name(pipeline: str, env: str, when: datetime | None = None) -> str:
    """The chain run's name: what ran, in which Kedro environment, when (local time, to the minute).

    ``chain_run_name("__default__", "local")`` → ``"full chain · env local · 2026-11-24 21:40"``;
    a named pipeline gives ``"pipeline evaluate · env local · …"``. What ran comes first: the runs
    table cuts long names.
    """
    what = "full chain" if pipeline in ("", "__default__") else f"pipeline {pipeline}"
    return f"{what} · env {env} · {(when or datetime.now()).strftime('%Y-%m-%d %H:%M')}"


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


def training_link_tags(manifest: Mapping[str, Any]) -> dict[str, str]:
    """Tags that link an evaluation to the training run of its checkpoint (from a model manifest)."""
    out = {
        "method": manifest.get("method"),
        "training_run_id": manifest.get("mlflow_run_id"),
        "checkpoint.path": manifest.get("path"),
        "checkpoint.model_id": manifest.get("mlflow_model_id"),
    }
    return {k: str(v) for k, v in out.items() if v}


def log_evaluation(result: Any, edges: Any) -> None:
    """One run per model × dataset (``evaluation.suite.EvaluationResult``) linked to the chain run:
    tags (``model``, ``dataset``; for a checkpoint ``method`` and its training run, linked), params,
    metrics (also on the checkpoint's model and the training run: :func:`log_heldout`), records, plot."""
    import tempfile
    from dataclasses import asdict

    import matplotlib.pyplot as plt

    from spader_pipeline.evaluation.plots import sample_figure

    if not active():
        return
    spec, dataset = result.model, result.dataset
    tags = {"model": spec.name, "dataset": dataset, "kind": spec.kind, **spec.training}
    note = _training_note(spec.training)
    if note:
        tags["mlflow.note.content"] = note
    with linked_run(f"evaluate:{spec.name}:{dataset}", tags), tempfile.TemporaryDirectory() as tmp:
        log_params({**spec.describe(), "dataset": dataset, "prompt_template": result.template_name,
                    **{f"rollout.{k}": v for k, v in asdict(result.rollout).items()}})
        values = numeric_items(result.metrics)
        mlflow.log_metrics(values, model_id=_model_in_store(spec.training.get("checkpoint.model_id")))
        log_heldout(spec.training.get("training_run_id"), dataset, values)
        path = Path(tmp) / f"{spec.name}__{dataset}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in result.records),
                        encoding="utf-8")
        log_artifact(path, "samples")
        fig = sample_figure(result.records, result.metrics, edges, f"{spec.name} on {dataset}")
        fig.savefig(Path(tmp) / f"{spec.name}__{dataset}.png", dpi=100)
        plt.close(fig)
        log_artifact(Path(tmp) / f"{spec.name}__{dataset}.png", "plots")


def _model_in_store(model_id: str | None) -> str | None:
    """The checkpoint's MLflow model id when it is in this tracking store, else ``None``."""
    try:
        return mlflow.get_logged_model(model_id).model_id if model_id else None
    except mlflow.exceptions.MlflowException:
        return None


def _training_note(link: Mapping[str, str]) -> str | None:
    """Markdown description of an evaluation run: which training run made the checkpoint (a link)."""
    run_id = link.get("training_run_id")
    if not run_id:
        return None
    try:
        run = mlflow.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return f"Checkpoint `{link.get('checkpoint.path')}` from training run `{run_id}` (not in this tracking store)."
    return f"Checkpoint `{link.get('checkpoint.path')}` trained in run [{run.info.run_name}]({run_url(run_id, run.info.experiment_id)})."


@contextmanager
def running_ui(
    tracking_uri: str, artifact_root: str | Path, *, host: str = "127.0.0.1", port: int | None = None,
    startup_timeout: float = 180.0, workers: int = 1,
) -> Iterator[str]:
    """Run ``mlflow ui`` (the tracking server: UI + REST API) on the store; yield its base URL.

    What ``make mlflow-ui`` runs, on a free loopback port; the server's process group is always
    stopped on exit.
    """
    from spader_pipeline.local_servers import free_port, stop_process_group, wait_healthy

    port = port or free_port(host)
    argv = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri,
            "--default-artifact-root", str(Path(artifact_root).resolve()), "--host", host, "--port", str(port),
            "--workers", str(workers)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, startup_timeout, process, name="mlflow ui", interval=0.5)
        yield url
    finally:
        stop_process_group(process)
