"""Nodes of ``make positive-control-verl``: does the loop learn the real task through verl too?

A verl cell is a positive-control cell (:func:`spader_pipeline.pipelines.positive_control.nodes.cell_settings`:
its seed, every fitted question trained on, every validation row scored) whose ``training.backend`` is
``verl``: verl's real loop on this machine (``positive_control_verl.verl``, laid over ``training.verl``;
``conf/base/parameters_positive_control_verl.yml``). It trains the native cells' design
(:func:`~spader_pipeline.launch.overrides.native_design_overrides`: the same questions per step, group
size, steps, temperature, PPO epochs and mini-batches, trajectory and search limits), so that a change of
the design reaches both trainers; what verl trains and at which learning rate is its own block's. verl
validates step 0 itself (``val_before_train``), on the same ``fitted_validation`` rows as one batch.

:func:`write_report` puts every cell of both trainers in one table, with a trainer column, under the
metric names both report (``val/fitted/recall``, ``val/<source>/recall``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spader_pipeline import tracking
from spader_pipeline.launch.overrides import native_design_overrides, native_search_tool
from spader_pipeline.launch.settings import verl_settings
from spader_pipeline.pipelines.positive_control.nodes import RUN_LABEL, cell_settings
from spader_pipeline.reporting.positive_control import FITTED_SOURCE
from spader_pipeline.training import TrainingSettings

#: the label of a verl cell's MLflow run (``positive control verl grpo seed0``) and its ``chain_kind`` tag
VERL_RUN_LABEL = f"{RUN_LABEL} verl"


def verl_cell_name(method: str, seed: int) -> str:
    """The namespace of one verl cell (``fit_grpo_verl_seed0``)."""
    return f"fit_{method}_verl_seed{int(seed)}"


def verl_cell_settings(training: Mapping[str, Any], verl_cells: Mapping[str, Any], seed: int) -> TrainingSettings:
    """One verl cell's typed ``training``: a positive-control cell's (seed, every fitted question,
    every validation row) under ``verl_cells.output_dir``, trained by verl with ``verl_cells.verl`` over
    ``training.verl``. Its overrides, in order: the native design's, the seed's, then the block's own."""
    native = cell_settings(training, str(verl_cells["output_dir"]), seed)
    block = dict(verl_cells.get("verl") or {})
    own = verl_settings(block)
    seed = int(seed)
    overrides = (*native_design_overrides(native.trainer), *native.verl.overrides,
                 f"actor_rollout_ref.rollout.seed={seed}", *own.overrides)
    verl = dataclasses.replace(native.verl, **{k: getattr(own, k) for k in block if k not in ("overrides", "search_tool")},
                               overrides=overrides, search_tool={**native_search_tool(native.trainer), **own.search_tool})
    # verl validates its questions in one batch (no per-source batch size) and samples every question alike
    # (the fitted questions' count for all)
    return native.with_changes(backend="verl", verl=verl, run_label=VERL_RUN_LABEL, validation={
        "batch_size": None, "trajectories": native.validation.trajectories_of(FITTED_SOURCE)})


def write_report(design: Mapping[str, Any], trainers: Mapping[str, str],
                 **histories: list[dict[str, float]]) -> tuple[str, Any, dict[str, float]]:
    """The positive control's report over the cells of both trainers (``trainers``: cell → ``native`` or
    ``verl``; keyword ``<cell>__history``): one table with a trainer column, each trainer's verdict
    (:func:`~spader_pipeline.reporting.positive_control.build_report`); markdown and figure also go to
    the MLflow chain run (the project hook logs the metrics as ``positive_control_verl/…``)."""
    from spader_pipeline.reporting.positive_control import build_report

    cells = {name.removesuffix("__history"): history for name, history in histories.items()}
    text, figure, metrics = build_report(cells, design, trainers=trainers)
    text = text.rstrip("\n") + "\n\n" + (
        "Each cell's step 0 is its own trainer's validation of the warm start: the native cells share one "
        "(validate_warm_start); verl validates before training, every validation question in one batch of its "
        "rollout server (docs/results.md, `make positive-control-verl`).\n")
    tracking.log_text(text, "positive_control_verl/report.md")
    tracking.log_figure(figure, "positive_control_verl/curves.png")
    return text, figure, metrics
