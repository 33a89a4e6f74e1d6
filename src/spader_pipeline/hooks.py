"""Kedro hooks: every ``kedro run`` is one MLflow run.

- ``before_pipeline_run`` opens the run in the configured experiment, tags it with the pipeline
  name, Kedro environment and git commit, and logs the run's parameters.
- ``after_node_run`` logs every node output whose dataset name ends in ``metrics`` (a dict of
  numbers) as MLflow metrics under the node's namespace; nodes stay free of MLflow code.
- ``after_pipeline_run`` ends the run as FINISHED; ``on_pipeline_error`` ends it as FAILED.

Configuration lives in ``conf/<env>/mlflow.yml`` (``tracking_uri``, ``experiment``, ``enabled``);
``MLFLOW_TRACKING_URI`` in the environment overrides the configured URI.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl

from spader_pipeline import tracking

logger = logging.getLogger(__name__)


class MlflowTrackingHooks:
    def __init__(self) -> None:
        self._config: dict[str, Any] = {}
        self._params: dict[str, Any] = {}
        self._project_path = Path.cwd()
        self._env = "local"
        self._started = False

    @hook_impl
    def after_context_created(self, context) -> None:
        self._project_path = Path(context.project_path)
        self._env = context.env or "local"
        try:
            self._config = dict(context.config_loader["mlflow"] or {})
        except KeyError:
            self._config = {}
        self._params = context.params

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog) -> None:
        if not self._config.get("enabled", True):
            return
        if mlflow.active_run() is not None:  # e.g. a notebook or test that opened its own run
            logger.info("MLflow run already active; logging into it")
            return
        uri = tracking.resolve_tracking_uri(self._config.get("tracking_uri"), self._project_path)
        mlflow.set_tracking_uri(uri)
        experiment = self._config.get("experiment", "spader-pipeline")
        if mlflow.get_experiment_by_name(experiment) is None:
            artifacts = (self._project_path / self._config.get("artifact_dir", tracking.DEFAULT_ARTIFACT_DIR)).resolve()
            artifacts.mkdir(parents=True, exist_ok=True)
            mlflow.create_experiment(experiment, artifact_location=artifacts.as_uri())
        mlflow.set_experiment(experiment)
        names = run_params.get("pipeline_names") or [run_params.get("pipeline_name")]
        pipeline_name = ",".join(name for name in names if name) or "__default__"
        mlflow.start_run(
            run_name=f"{pipeline_name}",
            tags={
                "kedro.pipeline": pipeline_name,
                "kedro.env": self._env,
                "kedro.session_id": str(run_params.get("session_id", "")),
                "git.commit": tracking.git_commit(self._project_path),
            },
        )
        self._started = True
        tracking.log_params(self._used_params(pipeline))
        logger.info("MLflow run %s (tracking %s)", mlflow.active_run().info.run_id, uri)

    def _used_params(self, pipeline) -> dict[str, Any]:
        """The parameter blocks this pipeline reads (``params:a.b`` inputs), keyed by their path."""
        used: dict[str, Any] = {}
        for name in sorted(pipeline.inputs()):
            if name == "parameters":
                return dict(self._params)
            if not name.startswith("params:"):
                continue
            value: Any = self._params
            for part in name.removeprefix("params:").split("."):
                value = value.get(part) if isinstance(value, dict) else None
            used[name.removeprefix("params:")] = value
        return used

    @hook_impl
    def after_node_run(self, node, outputs: dict[str, Any]) -> None:
        if not tracking.active():
            return
        for name, value in outputs.items():
            short = name.rsplit(".", 1)[-1]
            if short.endswith("metrics") and isinstance(value, dict):
                prefix = name.replace(".", "/").removesuffix("metrics").rstrip("_/")
                tracking.log_metrics(value, prefix=prefix)

    @hook_impl
    def after_pipeline_run(self, run_params, pipeline, catalog) -> None:
        self._end("FINISHED")

    @hook_impl
    def on_pipeline_error(self, error, run_params, pipeline, catalog) -> None:
        if self._started and tracking.active():
            mlflow.set_tag("error", f"{type(error).__name__}: {error}"[:5000])
        self._end("FAILED")

    def _end(self, status: str) -> None:
        if self._started and tracking.active():
            mlflow.end_run(status=status)
        self._started = False
