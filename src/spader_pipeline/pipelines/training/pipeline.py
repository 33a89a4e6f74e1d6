"""Pipelines of the training stage.

- :func:`warm_start_pipeline` — SFT on demonstrations → ``warm_start_manifest``.
- :func:`method_pipeline` — one RL run (native or VERL backend) from ``warm_start_manifest``; reused
  per method under the namespace ``train_<method>``: its datasets become
  ``train_<method>.policy_manifest`` / ``.training_history`` / ``.training_metrics`` and its method
  block ``params:train_<method>.method`` (``conf/base/parameters_training.yml``), while
  ``params:training`` (everything shared) stays common. Two methods therefore differ only in
  their ``train_<method>.method`` blocks. Each is one MLflow run (see :mod:`spader_pipeline.hooks`).
- :func:`create_pipeline` — the default ``training`` stage: warm start + the registry's default
  methods (:func:`~spader_pipeline.algorithms.methods.default_methods`: GRPO and SPADER).
"""

from kedro.pipeline import Pipeline, node, pipeline

from spader_pipeline.algorithms.methods import default_methods
from spader_pipeline.run_lock import CELL_TAG
from spader_pipeline.tracking import METHOD_RUN_TAG

from .nodes import train_policy, validate_warm_start, warm_start

SHARED_INPUTS = {"warm_start_manifest", "warm_start_validation", "verl_train", "verl_validation", "index_manifest"}
SHARED_PARAMS = {"params:training", "params:prompt"}


def warm_start_pipeline() -> Pipeline:
    return Pipeline(
        [
            node(
                warm_start,
                inputs=["base_model_manifest", "verl_train", "verl_validation", "index_manifest",
                        "params:warm_start", "params:prompt"],
                outputs=["warm_start_manifest", "warm_start_metrics"],
                name="warm_start",
            ),
            node(
                validate_warm_start,
                inputs=["warm_start_manifest", "verl_validation", "index_manifest", "params:training", "params:prompt"],
                outputs="warm_start_validation",
                name="validate_warm_start",
            ),
        ],
        tags="training",
    )


def method_pipeline(method: str) -> Pipeline:
    """The RL pipeline of one method, namespaced ``train_<method>``."""
    base = Pipeline(
        [
            node(
                train_policy,
                inputs=["warm_start_manifest", "verl_train", "index_manifest", "params:method",
                        "params:training", "params:prompt", "verl_validation", "warm_start_validation"],
                outputs=["policy_manifest", "training_history", "training_metrics"],
                name="train_policy",
                # one MLflow run per method's training; a cell: it writes only its namespace, so two
                # methods can train side by side on one data root (spader_pipeline.hooks)
                tags=[METHOD_RUN_TAG, CELL_TAG],
            )
        ],
        tags="training",
    )
    return pipeline(base, namespace=f"train_{method}", inputs=SHARED_INPUTS, parameters=SHARED_PARAMS)


def create_pipeline(**kwargs) -> Pipeline:
    methods = kwargs.get("methods") or default_methods()
    combined = warm_start_pipeline()
    for method in methods:
        combined += method_pipeline(method)
    return combined
