"""Nodes of ``make positive-control``: does the RL loop learn what it is rewarded for?

:func:`fitted_set` fixes the few training questions every cell trains on and the validation set that
scores them (the same questions, as data source ``fitted``, then the first questions of the
validation split, held out); the training stage's ``validate_warm_start`` scores the warm start on
it once (step 0 of every curve); each method × seed is a namespace running the training stage's
``train_policy`` on the fitted questions; :func:`write_report` gathers the curves
(:mod:`spader_pipeline.reporting.positive_control`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline import tracking
from spader_pipeline.reporting.positive_control import FITTED_GREEDY_SOURCE, FITTED_SOURCE, fitted_count
from spader_pipeline.training import TrainingSettings

logger = logging.getLogger(__name__)

#: Label of a cell's MLflow run name and its ``chain_kind`` tag.
RUN_LABEL = "positive control"


def cell_name(method: str, seed: int) -> str:
    """The namespace of one method × seed (``fit_grpo_seed0``)."""
    return f"fit_{method}_seed{int(seed)}"


def fitted_set(verl_train: pd.DataFrame, verl_validation: pd.DataFrame,
               design: Mapping[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The training rows every cell trains on and the validation rows that score them: those
    questions again with ``data_source`` ``fitted`` (``val/fitted/…``), with ``design.greedy_beside``
    once more as ``fitted_greedy`` (scored greedy, no target), then the first
    ``design.validation_questions`` of ``verl_validation`` (held out).

    The training rows are ``design.question_ids`` (in that order) when given, else ``design.questions``
    of ``verl_train`` drawn with ``design.question_seed``; the same for every cell either way."""
    ids = [str(i) for i in design.get("question_ids") or ()]
    if ids:
        train = _rows_with_ids(verl_train, ids)
    else:
        count = int(design["questions"])
        if not 1 <= count <= len(verl_train):
            raise ValueError(f"positive_control.questions={count}: choose 1..{len(verl_train)} (the training split)")
        picked = np.sort(np.random.default_rng(int(design.get("question_seed", 0))).choice(len(verl_train), count,
                                                                                          replace=False))
        train = verl_train.iloc[picked].reset_index(drop=True)
    held = verl_validation.head(int(design.get("validation_questions") or 0))
    greedy = [train.assign(data_source=FITTED_GREEDY_SOURCE)] if design.get("greedy_beside") else []
    validation = pd.concat([train.assign(data_source=FITTED_SOURCE), *greedy, held], ignore_index=True)
    logger.info("positive control: fitting %d training questions (%s), %d validation questions held out", len(train),
                ", ".join(str((e or {}).get("id")) for e in train["extra_info"]), len(held))
    return train, validation


def _rows_with_ids(verl_train: pd.DataFrame, ids: list[str]) -> pd.DataFrame:
    """The rows of ``verl_train`` whose ``extra_info.id`` are ``ids``, in that order; an id that is
    not in the training split stops the run (a fitted set is never silently smaller)."""
    position = {str((e or {}).get("id")): k for k, e in enumerate(verl_train["extra_info"])}
    missing = [i for i in ids if i not in position]
    if missing or len(set(ids)) != len(ids):
        raise ValueError(f"positive_control.question_ids: {missing or 'duplicates'} — each id once, from the "
                         f"training split ({len(verl_train)} questions; scripts/select_fitted_set.py lists candidates)")
    return verl_train.iloc[[position[i] for i in ids]].reset_index(drop=True)


def cell_settings(training: Mapping[str, Any], output_dir: str, seed: int) -> TrainingSettings:
    """One cell's typed ``training``: its seed, its own directory, every fitted question used and
    every validation row scored."""
    from spader_pipeline.pipelines.compare.nodes import seed_training

    seeded = seed_training(start_validation_settings(training), output_dir, seed)
    return seeded.with_changes(run_label=RUN_LABEL, max_train_questions=None)


def start_validation_settings(training: Mapping[str, Any]) -> TrainingSettings:
    """``training`` typed, scoring every validation row (the fitted set and the held-out questions):
    the warm start's step-0 validation and, through :func:`cell_settings`, every cell's."""
    return TrainingSettings.from_mapping(training).with_changes(validation={"max_questions": None})


def fitted_grain(design: Mapping[str, Any], training: Mapping[str, Any]) -> float:
    """The most one trajectory moves a cell's fitted score: ``1 / (fitted questions × trajectories per
    fitted question)`` (``training.validation.trajectories``)."""
    return 1.0 / (fitted_count(design) * TrainingSettings.from_mapping(training).validation.trajectories_of(FITTED_SOURCE))


def fitted_gauge(training: Mapping[str, Any]) -> str:
    """What a cell's fitted score is, in words: ``training.validation``'s trajectories per fitted
    question, their temperature and draws, or the greedy trajectory."""
    settings = TrainingSettings.from_mapping(training)
    validation, count = settings.validation, settings.validation.trajectories_of(FITTED_SOURCE)
    if count == 1:
        return "each question's greedy trajectory"
    temperature = validation.sampling_temperature(settings.trainer.temperature)
    return (f"each question's mean over {count} trajectories sampled at T = {temperature:g} from validation "
            f"seed {validation.seed}'s draws, the same for every cell")


def write_report(design: Mapping[str, Any], training: Mapping[str, Any],
                 **histories: list[dict[str, float]]) -> tuple[str, Any, dict[str, float]]:
    """The report (markdown, figure, metrics) over every cell's history (keyword ``<cell>__history``);
    markdown and figure also go to the MLflow chain run (the project hook logs the metrics as
    ``positive_control/…``)."""
    from spader_pipeline.reporting.positive_control import build_report

    cells = {name.removesuffix("__history"): history for name, history in histories.items()}
    text, figure, metrics = build_report(cells, design, grain=fitted_grain(design, training),
                                         gauge=fitted_gauge(training))
    tracking.log_text(text, "positive_control/report.md")
    tracking.log_figure(figure, "positive_control/curves.png")
    return text, figure, metrics
