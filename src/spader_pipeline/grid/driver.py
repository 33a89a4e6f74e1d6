"""The driver of a grid: one invocation of ``make compare`` or ``make positive-control``, on Ray.

Kedro describes the work: the registered pipeline of the run's environment, read as shared part,
cells and report (:mod:`.phases`). Ray runs it: the shared part as one task, then every cell as a
task of its own, each declaring its CPUs, GPUs and memory (:mod:`.settings`) and retried where its
worker or node died (:mod:`.tasks`); the report runs in the driver once every cell is stored.

- **Where**: ``grid.ray_address`` or ``RAY_ADDRESS`` (Ray's own convention) names a cluster; without
  either, the driver starts a Ray of its own on this machine and stops it at the end. On a cluster,
  the project (with its venv) is at the same path on every node, and so is the data root (shared
  storage): a job reads and writes there, and a retried cell resumes from what it finds there.
- **One grid per data root**: the driver holds the data root's lock for the grid's life
  (:mod:`spader_pipeline.run_lock`); its jobs run under that hold, with no lock of their own.
- **MLflow**: one grid run per invocation; every job's chain run is its child, a cell's being the
  cell's training run (the experiment page folds the grid under it); the report logs into the grid
  run itself, so the verdict, its intervals and its figure are on the parent. A job whose worker died
  left its run running: it is marked ``KILLED`` at the end (its metrics stay).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
import ray
from kedro.framework.project import pipelines
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from spader_pipeline import run_lock, tracking
from spader_pipeline.hooks import data_root, used_params
from spader_pipeline.local_ray import init_local_ray

from .phases import SHARED, Grid, has_work, kedro_args, split
from .settings import GridSettings, JobOptions, Node, cell_options, shared_options
from .tasks import JobKilled, run_job

logger = logging.getLogger(__name__)

#: What of the driver's environment every job gets (a worker on another node has its own environment):
#: the project's switches and the libraries' offline and telemetry settings. Not ``MLFLOW_RUN_ID``,
#: which would make a job log into one run.
PASSED_PREFIXES = ("SPADER_", "MLFLOW_", "KEDRO_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "MALLOC_", "GX_")
PASSED_NAMES = ("DO_NOT_TRACK", "PYTHONPATH")
NOT_PASSED = ("MLFLOW_RUN_ID",)
#: The object store of a Ray the driver starts: the jobs pass only their names and exit statuses.
OBJECT_STORE_BYTES = 256 * 2**20


class GridFailed(RuntimeError):
    """A job of the grid failed; what finished is stored, and the next invocation resumes from it."""


@dataclass
class GridOutcome:
    """What one invocation did: each job's seconds (``None``: nothing left to do), and its grid run."""

    seconds: dict[str, float | None] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None
    killed_runs: list[str] = field(default_factory=list)
    total_seconds: float = 0.0


def job_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` that every job of the grid gets."""
    return {k: v for k, v in environ.items()
            if (k.startswith(PASSED_PREFIXES) or k in PASSED_NAMES) and k not in NOT_PASSED}


@contextlib.contextmanager
def _environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (``None``: removed) for the body."""
    before = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        yield
    finally:
        for key, value in before.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _start_ray(address: str | None, env_vars: dict[str, str]) -> None:
    runtime_env = {"env_vars": env_vars}
    if address:
        logger.info("grid: connecting to the Ray cluster at %s", address)
        ray.init(address=address, runtime_env=runtime_env)
    else:
        logger.info("grid: starting a Ray on this machine for this grid (set RAY_ADDRESS for a cluster)")
        init_local_ray(include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES, runtime_env=runtime_env)


def _nodes() -> list[Node]:
    return [Node.from_ray(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _submit(name: str, args: list[str], options: JobOptions, project: Path, settings: GridSettings):
    logger.info("grid: %s on Ray (%s, %d torch thread%s)", name, options.ray_options(), options.threads,
                "" if options.threads == 1 else "s")
    return run_job.options(name=name, max_retries=settings.max_retries, retry_exceptions=[JobKilled],
                           **options.ray_options()).remote(name, args, str(project), options.threads)


def _wait(jobs: dict, outcome: GridOutcome) -> None:
    """Wait for every job (a ref → its name), recording its seconds or its error."""
    pending = dict(jobs)
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            name = pending.pop(done[0])
            try:
                outcome.seconds[name] = ray.get(done[0])
                logger.info("grid: %s finished in %.0f s", name, outcome.seconds[name])
            except ray.exceptions.RayError as error:
                outcome.failed[name] = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
                logger.error("grid: %s failed: %s", name, outcome.failed[name])
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise


def _open_grid_run(pipeline_name: str, env: str, project: Path, mlflow_config: Mapping, grid: Grid,
                   params: dict) -> str | None:
    """Open the grid run (the active run of this process), holding the parameters of the whole grid."""
    if not mlflow_config.get("enabled", True):
        return None
    tracking.use_experiment(mlflow_config, project)
    tags = {"kedro.pipeline": pipeline_name, "kedro.env": env, "git.commit": tracking.git_commit(project),
            tracking.GRID_TAG: "true", "grid.cells": ",".join(grid.cells)}
    run = mlflow.start_run(run_name=tracking.grid_run_name(pipeline_name, env), tags=tags)
    tracking.log_params(used_params(grid.shared + sum(grid.cells.values(), grid.report), params))
    return run.info.run_id


@dataclass(frozen=True)
class _Plan:
    """What one invocation runs: the grid, which of its parts have work left, where and how."""

    project: Path
    env: str
    pipeline: str
    grid: Grid
    shared_work: bool
    cells_left: list[str]
    settings: GridSettings


def _run_jobs(plan: _Plan, outcome: GridOutcome) -> None:
    """The shared part, then every cell left, as Ray tasks on the Ray this process is connected to."""
    nodes = _nodes()
    # each kind of cell (a pattern of grid.cells, else grid.cell) shares the node among the cells of its kind
    # (MLflow's parameter names take no "*": a pattern's options are logged under its position, beside it)
    cell_opts: dict[str, JobOptions] = {}
    kinds: dict[str, dict] = {}
    patterns = list(plan.settings.cells)
    for resources, group in plan.settings.cell_groups(plan.cells_left):
        options = cell_options(resources, nodes, len(group))
        cell_opts.update(dict.fromkeys(group, options))
        pattern = plan.settings.pattern_of(group[0])
        kinds["cell" if pattern is None else f"cells.{patterns.index(pattern)}"] = (
            options.ray_options() | {"threads": options.threads} | ({} if pattern is None else {"pattern": pattern}))
    if "cell" not in kinds:
        options = cell_options(plan.settings.cell, nodes, len(plan.cells_left))
        kinds["cell"] = options.ray_options() | {"threads": options.threads}
    shared_opts = shared_options(plan.settings.shared, nodes)
    tracking.log_params({"grid": {"ray_address": plan.settings.ray_address or os.environ.get("RAY_ADDRESS") or "local",
                                  "nodes": len(nodes), "max_retries": plan.settings.max_retries,
                                  **kinds,
                                  "shared": shared_opts.ray_options() | {"threads": shared_opts.threads}}})
    if plan.shared_work:
        args = kedro_args(plan.env, plan.pipeline, nodes=plan.grid.shared)
        _wait({_submit(SHARED, args, shared_opts, plan.project, plan.settings): SHARED}, outcome)
    else:
        logger.info("grid: the shared part is stored already")
    if outcome.failed:
        return
    done = [cell for cell in plan.grid.cells if cell not in plan.cells_left]
    if done:
        logger.info("grid: %s stored already", ", ".join(done))
    _wait({_submit(cell, kedro_args(plan.env, plan.pipeline, cell=cell), cell_opts[cell], plan.project, plan.settings):
           cell for cell in plan.cells_left}, outcome)


def _plan(project: Path, env: str, pipeline_name: str) -> tuple[_Plan, Path, dict, dict]:
    """Read the grid from the project's Kedro context: the plan, the data root, the parameters and
    the MLflow configuration of ``env``."""
    bootstrap_project(project)
    with KedroSession.create(project_path=project, env=env) as session:
        context = session.load_context()  # first: the registry builds the cells of this run's parameters
        grid = split(pipelines[pipeline_name], pipeline_name)
        plan = _Plan(project, env, pipeline_name, grid, has_work(grid.shared, context.catalog),
                     [cell for cell, part in grid.cells.items() if has_work(part, context.catalog)],
                     GridSettings.from_mapping(context.params.get("grid")))
        try:
            mlflow_config = dict(context.config_loader["mlflow"] or {})
        except KeyError:
            mlflow_config = {}
        return plan, data_root(context), context.params, mlflow_config


def run_grid(project: Path, env: str, pipeline_name: str) -> GridOutcome:
    """Run the grid of ``pipeline_name`` in Kedro environment ``env`` of the project at ``project``;
    raise :class:`GridFailed` naming the jobs that failed (after every other job has ended)."""
    started = time.monotonic()
    plan, root, params, mlflow_config = _plan(Path(project).resolve(), env, pipeline_name)
    outcome = GridOutcome(seconds={name: None for name in [SHARED, *plan.grid.cells]})
    held = run_lock.acquire(root, pipeline_name, env)
    status = "FAILED"
    try:
        outcome.run_id = _open_grid_run(pipeline_name, env, plan.project, mlflow_config, plan.grid, params)
        env_vars = job_environment(os.environ)
        env_vars.pop(tracking.GRID_RUN_ENV, None)
        env_vars[run_lock.HOLD_ENV] = held.info.token
        if outcome.run_id:
            env_vars.update({tracking.GRID_RUN_ENV: outcome.run_id, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()})
        _start_ray(plan.settings.ray_address or os.environ.get("RAY_ADDRESS"), env_vars)
        try:
            _run_jobs(plan, outcome)
        finally:
            ray.shutdown()
        if outcome.failed:
            raise GridFailed(f"grid {pipeline_name}: " + "; ".join(f"{k}: {v}" for k, v in outcome.failed.items())
                             + ". What finished is stored: run the grid again to resume.")
        if plan.grid.report.nodes:  # in this process, logging into the grid run
            report_started = time.monotonic()
            with _environment({run_lock.HOLD_ENV: held.info.token, tracking.GRID_RUN_ENV: None}), \
                    KedroSession.create(project_path=plan.project, env=env) as session:
                session.run(pipeline_names=[pipeline_name], node_names=[n.name for n in plan.grid.report.nodes])
            outcome.seconds["report"] = time.monotonic() - report_started
        status = "FINISHED"
    finally:
        outcome.total_seconds = time.monotonic() - started
        if outcome.run_id:
            outcome.killed_runs = tracking.end_unfinished_children(outcome.run_id)
            tracking.log_metrics({f"grid/{name.replace(' ', '_')}/seconds": s
                                  for name, s in outcome.seconds.items() if s is not None})
            tracking.log_metrics({"grid/seconds": outcome.total_seconds})
            if outcome.killed_runs:
                mlflow.set_tag("grid.killed_runs", ", ".join(outcome.killed_runs))
            mlflow.end_run(status=status)
        held.release()
    return outcome
