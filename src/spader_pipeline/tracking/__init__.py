"""MLflow tracking of the project, one concern per module:

* :mod:`.store`: where the runs are stored (the tracking URI) and the project's experiment;
* :mod:`.runs`: the runs themselves — the chain run of a ``kedro run``, a method's training run, the
  runs linked to them — and what nodes, trainers and plugins log into them;
* :mod:`.provenance`: which source a run ran from (the git commit);
* :mod:`.ui`: the MLflow UI server on a store.

Callers import this package (``from spader_pipeline import tracking``); the names below are its
interface. The buffered writer that never blocks a training step is
:mod:`spader_pipeline.tracking_buffer`; an evaluation's run is
:func:`spader_pipeline.evaluation.mlflow_runs.log_evaluation`.
"""

from spader_pipeline.tracking.provenance import git_commit
from spader_pipeline.tracking.runs import (
    ADOPT_TAG,
    CHAIN_RUN_TAG,
    CHAIN_TAG,
    COMPARABLE_FIRST,
    HELDOUT_KEYS,
    METHOD_DEPENDENT_PREFIX,
    METHOD_RUN_TAG,
    active,
    active_run_id,
    chain_run_name,
    comparable_first,
    flatten,
    handed_over_run,
    linked_run,
    log_artifact,
    log_figure,
    log_heldout,
    log_metrics,
    log_metrics_to_run,
    log_params,
    log_text,
    method_run,
    model_in_store,
    numeric_items,
    register_checkpoint,
    run_url,
    training_link_tags,
    training_note,
)
from spader_pipeline.tracking.store import (
    DEFAULT_ARTIFACT_DIR,
    DEFAULT_TRACKING_URI,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    ensure_experiment,
    resolve_tracking_uri,
)
from spader_pipeline.tracking.ui import running_ui

__all__ = [
    "ADOPT_TAG",
    "CHAIN_RUN_TAG",
    "CHAIN_TAG",
    "COMPARABLE_FIRST",
    "DEFAULT_ARTIFACT_DIR",
    "DEFAULT_TRACKING_URI",
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "HELDOUT_KEYS",
    "METHOD_DEPENDENT_PREFIX",
    "METHOD_RUN_TAG",
    "active",
    "active_run_id",
    "chain_run_name",
    "comparable_first",
    "ensure_experiment",
    "flatten",
    "git_commit",
    "handed_over_run",
    "linked_run",
    "log_artifact",
    "log_figure",
    "log_heldout",
    "log_metrics",
    "log_metrics_to_run",
    "log_params",
    "log_text",
    "method_run",
    "model_in_store",
    "numeric_items",
    "register_checkpoint",
    "resolve_tracking_uri",
    "run_url",
    "running_ui",
    "training_link_tags",
    "training_note",
]
