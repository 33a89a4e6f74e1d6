"""Where the runs are stored and the experiment they go in: the tracking URI and the project's
MLflow experiment (tagged so that the UI opens it on the runs table)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
DEFAULT_ARTIFACT_DIR = "mlruns/artifacts"

#: The experiment tag that makes the MLflow UI open a training project in its model-training view
#: (runs table, metric charts) rather than the GenAI traces view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


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


def ensure_experiment(name: str, artifact_location: Path | None = None) -> str:
    """Create (or find) the experiment ``name``, tagged as a model-training experiment; return its id.

    An existing experiment that lacks :data:`EXPERIMENT_KIND_TAG` (created by an older version, or by
    VERL's own tracker) gets it, so the UI opens it on the runs table. Jobs started together on one
    store (a comparison's cells, docs/compare.md) may both find no experiment: the one whose creation
    loses the race uses the winner's.
    """
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        kwargs: dict[str, Any] = {"tags": {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}}
        if artifact_location is not None:
            artifact_location.mkdir(parents=True, exist_ok=True)
            kwargs["artifact_location"] = artifact_location.resolve().as_uri()
        try:
            return client.create_experiment(name, **kwargs)
        except MlflowException as exc:
            experiment = client.get_experiment_by_name(name)  # created by another job meanwhile
            if experiment is None or exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


def use_experiment(config: Mapping[str, Any], project_path: Path) -> str:
    """Point this process's MLflow at the store and experiment of ``config`` (an environment's
    ``mlflow.yml``: ``tracking_uri``, ``experiment``, ``artifact_dir``), as every ``kedro run`` and a
    grid's driver do; return the tracking URI, absolute (:func:`resolve_tracking_uri`)."""
    uri = resolve_tracking_uri(config.get("tracking_uri"), project_path)
    mlflow.set_tracking_uri(uri)
    artifacts = project_path / config.get("artifact_dir", DEFAULT_ARTIFACT_DIR)
    mlflow.set_experiment(experiment_id=ensure_experiment(config.get("experiment", "spader-pipeline"), artifacts))
    return uri
