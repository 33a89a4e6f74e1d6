"""Validation during training: greedy scores on a fixed subset of the validation split.

Both trainers validate on the same schedule and log the same names (docs/metrics.md):

- at step 0 (before the first update) when ``before_train``, then every ``every`` steps and at the
  last step — verl's ``trainer.val_before_train`` / ``trainer.test_freq``;
- on the first ``max_questions`` questions of ``verl_validation`` (a fixed subset, so every point of
  a curve scores the same questions; verl's ``data.val_max_samples`` without shuffling);
- greedy (temperature 0, one trajectory per question: verl's ``val_kwargs``), in one batch or, on the
  native trainer, in batches of ``batch_size`` questions (1: each question's score batch-invariant);
  or ``trajectories`` sampled per question (verl's ``val_kwargs.n`` with ``do_sample``), a question's
  score the mean over them;
- as ``val/<data_source>/recall``, ``…/f1`` and ``…/searches`` (means over questions).

The test split is never scored during training: hyperparameters and stopping steps are chosen on these
curves, and ``evaluate`` scores the test split once, at the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["VAL_PREFIX", "ValidationSettings", "validation_batches", "validation_metrics", "validation_subset"]

VAL_PREFIX = "val"


@dataclass(frozen=True)
class ValidationSettings:
    """``training.validation``: when and on what the policy is validated (both backends)."""

    every: int = 1
    """validate after every this-many RL steps and at the last step (verl ``trainer.test_freq``); 0: never"""
    before_train: bool = True
    """validate the starting policy as step 0 (verl ``trainer.val_before_train``)"""
    max_questions: int | None = 24
    """the first this-many validation questions (verl ``data.val_max_samples``); ``None``: all"""
    batch_size: int | Mapping[str, int] | None = None
    """how many questions are decoded together (native trainer). ``None``: all in one batch, the fastest.
    An int: batches of that many, in order. A mapping ``{data_source: n}``: that source's questions in
    batches of ``n`` of their own, every other question in one batch. ``1`` makes a question's greedy
    trajectory independent of the questions validated beside it: a batch's shape and padding change
    floating-point sums (much more under bf16 autocast), and that can turn a near-tied greedy token.
    verl decodes its validation set as one batch and has no such setting (``launch.overrides``
    refuses it)."""
    trajectories: int | Mapping[str, int] = 1
    """trajectories per question. ``1``: one greedy trajectory. ``n > 1``: ``n`` sampled at
    :attr:`temperature`, the question's recall, F1 and searches the means over them (verl:
    ``val_kwargs.n`` with ``do_sample``), so one trajectory moves a source's mean by at most
    ``1 / (questions × n)``. A mapping ``{data_source: n}``: that source's questions ``n`` each, every
    other question greedy (native trainer only). On the native trainer a sampled question's ``n`` rows are
    decoded together, drawn from a generator seeded by :attr:`seed` and the question's position in the
    subset, whatever the training seed: every point of a curve, and every run of a grid, scores its
    policy with the same random numbers."""
    temperature: float | None = None
    """the sampled trajectories' temperature; ``None``: the training's sampling temperature"""
    seed: int = 0
    """the sampled trajectories' seed (native trainer; verl draws with its rollout's own)"""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"validation.every={self.every}: use 0 (never) or a positive step interval")
        if self.max_questions is not None and self.max_questions < 1:
            raise ValueError(f"validation.max_questions={self.max_questions}: use null (all) or at least 1")
        sizes = self.batch_size.values() if isinstance(self.batch_size, Mapping) else [self.batch_size]
        if any(size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1)
               for size in sizes):
            raise ValueError(f"validation.batch_size={self.batch_size!r}: use null (one batch), a count of at least "
                             "1, or {data_source: count}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self._counts()):
            raise ValueError(f"validation.trajectories={self.trajectories!r}: use a count of at least 1 (1: greedy), "
                             "or {data_source: count}")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"validation.temperature={self.temperature}: sampled trajectories need a temperature "
                             "above 0 (null: the training's)")

    def trajectories_of(self, data_source: str) -> int:
        """Trajectories per question of ``data_source`` (1: greedy)."""
        if isinstance(self.trajectories, Mapping):
            return int(self.trajectories.get(data_source, 1))
        return int(self.trajectories)

    @property
    def sampled(self) -> bool:
        """Whether any question is scored on sampled trajectories."""
        return any(n > 1 for n in self._counts())

    def sampling_temperature(self, training_temperature: float) -> float:
        """The sampled trajectories' temperature: :attr:`temperature`, else the training's."""
        return training_temperature if self.temperature is None else self.temperature

    def _counts(self) -> list[Any]:
        return list(self.trajectories.values()) if isinstance(self.trajectories, Mapping) else [self.trajectories]

    def due(self, step: int, total_steps: int) -> bool:
        """Whether step ``step`` (0 = before training) is validated."""
        if step == 0:
            return self.before_train
        return self.every > 0 and (step % self.every == 0 or step == total_steps)


def validation_subset(samples: Sequence[Mapping[str, Any]], max_questions: int | None) -> list[Mapping[str, Any]]:
    """The fixed validation subset: the first ``max_questions`` samples in file order."""
    return list(samples if max_questions is None else samples[:max_questions])


def validation_batches(data_sources: Sequence[str], batch_size: int | Mapping[str, int] | None) -> list[list[int]]:
    """The questions of each validation batch, as indices into ``data_sources`` (``[Q]``, one per
    question), following :attr:`ValidationSettings.batch_size`: every index once, in order within a
    batch; with a mapping, each named source's batches first (in order of the source's first
    question), then one batch of every other question."""
    indices = list(range(len(data_sources)))
    if not isinstance(batch_size, Mapping):
        return _chunks(indices, batch_size or len(indices))
    batches: list[list[int]] = []
    for source in dict.fromkeys(data_sources):
        if source in batch_size:
            batches += _chunks([i for i in indices if data_sources[i] == source], int(batch_size[source]))
    return batches + _chunks([i for i in indices if data_sources[i] not in batch_size], len(indices))


def _chunks(rows: list[int], size: int) -> list[list[int]]:
    """``rows`` in consecutive pieces of ``size`` (the last one shorter); none for no rows."""
    return [rows[k : k + size] for k in range(0, len(rows), size)] if rows else []


def validation_metrics(
    data_sources: Sequence[str], recall: Sequence[float], f1: Sequence[float], searches: Sequence[float]
) -> dict[str, float]:
    """``val/<data_source>/{recall,f1,searches}``: means over the questions of each data source.

    Args:
        data_sources: ``[Q]`` data source of each validation question (e.g. ``embedded``).
        recall, f1: ``[Q]`` answer recall and F1 of each question's greedy trajectory.
        searches: ``[Q]`` search turns of each trajectory.
    """
    sources = np.asarray(list(data_sources), dtype=object)
    values = {"recall": np.asarray(recall, float), "f1": np.asarray(f1, float),
              "searches": np.asarray(searches, float)}
    if any(len(v) != len(sources) for v in values.values()):
        raise ValueError("data_sources, recall, f1 and searches must have one entry per question")
    out: dict[str, float] = {}
    for source in sorted(set(sources.tolist())):
        rows = sources == source
        for name, column in values.items():
            out[f"{VAL_PREFIX}/{source}/{name}"] = float(column[rows].mean())
    return out
