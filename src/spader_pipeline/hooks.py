"""Kedro hooks: every ``kedro run`` is one MLflow run; every method's training run is one too.

- ``before_pipeline_run`` opens the run (the *chain* run) in the configured experiment (created
  with ``mlflow.experimentKind=custom_model_development``, the UI's model-training view), names it
  for what ran (:func:`spader_pipeline.tracking.chain_run_name`: pipeline, environment, time), tags
  it with the pipeline name, Kedro environment and git commit, and logs the parameters the
  pipeline reads.
  When the pipeline is a single method's training (``kedro run --pipeline train_spader``), or one
  cell (``--namespaces grpo_seed0``), that run *is* the method's run: the training node adopts it
  (:func:`spader_pipeline.tracking.method_run`) instead of linking another run to it.
  A job of a grid on Ray (:mod:`spader_pipeline.grid`) nests its run under the grid run whose id it
  was handed (``mlflow.parentRunId``), tagged with its part (``grid.job``), and logs no parameters:
  the grid run holds them.
- Training nodes (Kedro tag ``mlflow_method_run``) log into their own method run; every other
  node's outputs whose dataset name ends in ``metrics`` (a dict of numbers) are logged here as
  metrics of the ``kedro run`` run under the node's namespace.
- ``after_pipeline_run`` ends the run as FINISHED; ``on_pipeline_error`` ends it as FAILED.

:class:`DataRootLockHooks` holds the data root's lock for the run's life
(:mod:`spader_pipeline.run_lock`): a run made only of compare cells (``--namespaces grpo_seed0``)
holds those cells, any other run the whole root; a run in the way stops before anything starts. A
grid's job runs under its driver's hold instead (``SPADER_DATA_ROOT_HOLD``), taking no lock.

:class:`CompareCellsHooks` makes the run's environment decide the compare cells: it keeps the
cells of the context's ``compare`` parameters for the pipeline registry, which loads after it, and
stops a run whose registered cells differ from its parameters before anything starts.

:class:`TrainingSettingsHooks` types the ``training`` and ``warm_start`` parameters (and the method blocks a run reads)
as the run starts: a misspelt key or a bad value stops it before anything starts.

:class:`ForkServerHooks` starts the fork server of the stages' child processes
(:mod:`spader_pipeline.child_process`) as a run starts, when the run has a node that uses it, so
that the server's imports overlap the run's first nodes instead of delaying its first child.

Training and evaluation nodes open their own runs through :mod:`spader_pipeline.tracking` (one per
method, one per model × dataset): top-level runs linked to the chain run by tags, so the runs
table shows them at first sight; all other nodes hold no MLflow code.

Configuration lives in ``conf/<env>/mlflow.yml`` (``tracking_uri``, ``experiment``, ``enabled``);
``MLFLOW_TRACKING_URI`` in the environment overrides the configured URI.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl

from spader_pipeline import run_lock, tracking

logger = logging.getLogger(__name__)


#: A method's block among a run's inputs (``params:train_grpo.method``): the method run logs it itself.
METHOD_BLOCK = re.compile(r"params:train_\w+\.method")


def lone_method_node(pipeline) -> Any | None:
    """The training node when ``pipeline`` is exactly one method's training run: that node alone, or
    one cell (the nodes of one namespace, all tagged ``cell``) with one training node; else ``None``."""
    nodes = list(pipeline.nodes)
    methods = [n for n in nodes if tracking.METHOD_RUN_TAG in n.tags]
    if len(methods) != 1:
        return None
    if len(nodes) == 1 or len(locked_cells(pipeline)) == 1:
        return methods[0]
    return None


def data_root(context) -> Path:
    """The data root of a Kedro context: ``globals:data_root`` (``data`` by default) under its project."""
    try:
        root = (context.config_loader["globals"] or {}).get("data_root")
    except KeyError:
        root = None
    return Path(context.project_path) / (root or "data")


def used_params(pipeline, params: dict[str, Any], skip: set[str] = frozenset()) -> dict[str, Any]:
    """The parameter blocks ``pipeline`` reads (``params:a.b`` inputs) in ``params``, keyed by their
    path; every parameter when it reads ``parameters``. ``skip``: inputs to leave out."""
    used: dict[str, Any] = {}
    for name in sorted(pipeline.inputs()):
        if name == "parameters":
            return dict(params)
        if not name.startswith("params:") or name in skip:
            continue
        path = name.removeprefix("params:")
        value: Any = params
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        used[path] = value
    return used


def pipeline_label(run_params: dict[str, Any]) -> str:
    """The pipeline(s) a run names (``__default__`` for the whole chain)."""
    names = run_params.get("pipeline_names") or [run_params.get("pipeline_name")]
    return ",".join(name for name in names if name) or "__default__"


def locked_cells(pipeline) -> list[str]:
    """The cells a run writes when it runs cells alone (every node tagged :data:`~spader_pipeline.run_lock.CELL_TAG`): their
    top-level namespaces; ``[]`` when the run writes anything else (it then holds the whole root)."""
    nodes = list(pipeline.nodes)
    if not nodes or not all(run_lock.CELL_TAG in n.tags and n.namespace for n in nodes):
        return []
    return sorted({n.namespace.split(".")[0] for n in nodes})


class DataRootLockHooks:
    """The data root (``globals:data_root``) or the cells a run writes, held for the run's whole life.

    The lock is taken before the other hooks run (a hook wrapper), so a busy root stops the run
    before its MLflow run opens, and released last. One instance serves every session of a
    process, so locks are kept per session. ``lease_seconds`` and ``renew_seconds``: the locks'
    lease and renewal period (:mod:`spader_pipeline.run_lock`'s defaults when ``None``).
    """

    def __init__(self, lease_seconds: float | None = None, renew_seconds: float | None = None) -> None:
        self.lease_seconds, self.renew_seconds = lease_seconds, renew_seconds
        self._roots: dict[tuple[str, str], Path] = {}
        self._held: dict[str, run_lock.HeldLock] = {}

    @hook_impl
    def after_context_created(self, context) -> None:
        self._roots[(Path(context.project_path).as_posix(), context.env or "local")] = data_root(context)

    @hook_impl(wrapper=True)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog):
        """Take the lock around the other hooks (the MLflow run opens inside it); give it back when
        one of them fails, since Kedro then calls no ``on_pipeline_error``. A grid's job
        (:data:`~spader_pipeline.run_lock.HOLD_ENV` set) checks its driver's hold instead."""
        env = run_params.get("env") or "local"
        root = self._roots.get((str(run_params.get("project_path")), env))
        hold = os.environ.get(run_lock.HOLD_ENV)
        if root is not None and hold:
            run_lock.check_hold(root, hold)
        elif root is not None:
            self._held[str(run_params.get("run_id"))] = run_lock.acquire(
                root, pipeline_label(run_params), env, cells=locked_cells(pipeline),
                lease_seconds=self.lease_seconds, renew_seconds=self.renew_seconds)
        try:
            return (yield)
        except BaseException:
            self._release(run_params)
            raise

    @hook_impl(trylast=True)
    def after_pipeline_run(self, run_params, pipeline, catalog) -> None:
        self._release(run_params)

    @hook_impl(trylast=True)
    def on_pipeline_error(self, error, run_params, pipeline, catalog) -> None:
        self._release(run_params)

    def _release(self, run_params: dict[str, Any]) -> None:
        held = self._held.pop(str(run_params.get("run_id")), None)
        if held is not None:
            held.release()


class CompareCellsHooks:
    """The run's parameters decide the compare cells (docs/compare.md, "Cells come from conf").

    Kedro loads the pipeline registry inside ``session.run``, right after the run's context is
    created (the first ``context.params`` read). This hook runs first and keeps the cells of the
    context's parameters, read straight from its config loader (:attr:`run_cells`), which the
    registry passes to the compare pipeline's factory
    (:func:`spader_pipeline.pipeline_registry.register_pipelines`); before the pipeline runs it
    checks that the registered cells are the run's, and stops the run otherwise (a registry built
    earlier in the same process from other parameters).
    """

    def __init__(self) -> None:
        self._compare: dict[tuple[str, str], Any] = {}
        self.run_cells: list[tuple[str, int]] | None = None
        """(method, seed) of the latest run context's ``compare`` block; ``None`` before any run"""

    @hook_impl(tryfirst=True)
    def after_context_created(self, context) -> None:
        from spader_pipeline.pipelines.compare.pipeline import design_cells

        try:
            parameters = context.config_loader["parameters"] or {}
        except KeyError:
            parameters = {}
        self._compare[(Path(context.project_path).as_posix(), context.env or "local")] = parameters.get("compare")
        self.run_cells = design_cells(parameters.get("compare"))

    @hook_impl(wrapper=True, tryfirst=True)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog):
        """Before every other hook (the lock, the MLflow run): a run with compare nodes must have
        been registered with its own cells."""
        key = (str(run_params.get("project_path")), run_params.get("env") or "local")
        if key in self._compare and any("compare" in n.tags for n in pipeline.nodes):
            from kedro.framework.project import pipelines

            from spader_pipeline.pipelines.compare.pipeline import check_registered_cells

            if "compare" in pipelines:
                check_registered_cells(pipelines["compare"], key[1], self._compare[key])
        return (yield)


class TrainingSettingsHooks:
    """A run that reads ``training`` or ``warm_start`` types them (and each method block it reads) as
    it starts (:class:`~spader_pipeline.training.TrainingSettings`,
    :class:`~spader_pipeline.native.warm_start.WarmStartSettings`), before every other hook: an unknown
    key or a bad value stops the run before its MLflow run or any child process (the fork server, the
    warm start) starts, naming the key's full path and what the block takes (the data root's lock,
    taken around every hook, is given back). The nodes type the same settings again where they use
    them (a compare cell's are its own, seeded)."""

    @hook_impl(tryfirst=True)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog) -> None:
        read = {name for node in pipeline.nodes for name in node.inputs}
        if "params:warm_start" in read:
            from spader_pipeline.native.warm_start import WarmStartSettings

            WarmStartSettings.from_mapping(catalog.load("params:warm_start"))
        if "params:training" not in read:
            return
        from spader_pipeline.training import TrainingSettings

        training = TrainingSettings.from_mapping(catalog.load("params:training"))
        for name in sorted(read):
            if METHOD_BLOCK.fullmatch(name):
                training.with_method(catalog.load(name))


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
        uri = tracking.use_experiment(self._config, self._project_path)
        pipeline_name = pipeline_label(run_params)
        tags = {
            "kedro.pipeline": pipeline_name,
            "kedro.env": self._env,
            "kedro.session_id": str(run_params.get("run_id") or run_params.get("session_id") or ""),
            "git.commit": tracking.git_commit(self._project_path),
        }
        lone = lone_method_node(pipeline)
        if lone is not None:
            tags[tracking.ADOPT_TAG] = "true"  # the training node makes this run its method run
        grid, part = tracking.grid_parent(), None
        if grid:
            part = ",".join(locked_cells(pipeline)) or "shared part"
            tags[tracking.GRID_JOB_TAG] = part
        mlflow.start_run(run_name=tracking.chain_run_name(pipeline_name, self._env, part=part), tags=tags,
                         parent_run_id=grid)
        self._started = True
        if not grid:  # a grid's run holds the parameters of its jobs
            # the method run logs its method block under namespace-free names (two methods' runs share keys)
            skip = {name for name in lone.inputs if METHOD_BLOCK.fullmatch(name)} if lone else set()
            tracking.log_params(used_params(pipeline, self._params, skip))
        logger.info("MLflow run %s (tracking %s)", mlflow.active_run().info.run_id, uri)

    @hook_impl
    def after_node_run(self, node, outputs: dict[str, Any]) -> None:
        if not tracking.active() or tracking.METHOD_RUN_TAG in node.tags:
            return  # training nodes log into their own method run
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


class ForkServerHooks:
    """Starts the fork server of :mod:`spader_pipeline.child_process` when a run that will use it
    starts: one with a node marked :func:`~spader_pipeline.child_process.runs_child_processes` (the
    base model, the warm start, its validation, training, evaluation), run in this process (not
    ParallelRunner's workers, which start their own).

    Last of the ``before_pipeline_run`` hooks: a run the lock or the cell check refuses starts none."""

    @hook_impl(trylast=True)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog) -> None:
        if "ParallelRunner" in str(run_params.get("runner")):
            return
        if any(getattr(node.func, "runs_child_processes", False) for node in pipeline.nodes):
            from spader_pipeline.child_process import start_server

            if start_server():
                logger.debug("fork server of the stages' child processes started")
