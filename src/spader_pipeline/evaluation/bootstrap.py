"""Confidence intervals for a seeded comparison of two training methods (``make compare``).

A held-out score of a method varies with the questions asked and with the training seed. Both
sources are resampled together: a bootstrap replicate draws ``S`` seeds and ``Q`` questions with
replacement and recomputes the score on that [S, Q] grid (a two-level, "seeds × questions"
bootstrap). For the difference of two methods the same draw is applied to both (paired): seed
``k`` of each method starts from the same warm start with the same seed, and every question is
answered by both.

Scores are ratios of sums, ``sum(numerator) / sum(denominator)`` over the grid: a per-question mean
such as recall has denominator 1; a micro-average such as long-tail recall (hits over long-tail
gold entities) has the counts. Questions whose denominator is 0 contribute nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

__all__ = ["DesignNeeds", "Interval", "PairedDifference", "SeedInterval", "bootstrap_interval", "design_needs",
           "paired_difference", "paired_t_interval", "wider"]

_Z_POWER_80 = NormalDist().inv_cdf(0.8)  # power 0.8 of the design


@dataclass(frozen=True)
class Interval:
    """A point estimate with its percentile bootstrap interval."""

    mean: float
    low: float
    high: float
    confidence: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class PairedDifference(Interval):
    """``B − A`` with its paired interval, the share of replicates ≤ 0 (a one-sided bootstrap
    p-value for "B is not better") and the smallest difference the design detects (two-sided
    level ``1 − confidence``, power 0.8, from the bootstrap standard error)."""

    std_error: float
    p_not_better: float
    detectable: float

    @property
    def contains_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


def _draws(shape: tuple[int, int], resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seed indices ``[R, S]`` and question indices ``[R, Q]`` of ``resamples`` replicates."""
    rng = np.random.default_rng(seed)
    seeds, questions = shape
    return rng.integers(0, seeds, (resamples, seeds)), rng.integers(0, questions, (resamples, questions))


def _replicates(num: np.ndarray, den: np.ndarray, seed_idx: np.ndarray, q_idx: np.ndarray) -> np.ndarray:
    """Ratio of sums of each replicate, ``[R]``: ``num``/``den`` are ``[S, Q]``.

    Sum over the drawn grid = Σ_s Σ_q num[seed_idx[r, s], q_idx[r, q]], computed as counts of draws
    times values (no [R, S, Q] tensor): seed counts ``[R, S]`` @ num ``[S, Q]`` @ question counts.
    """
    seeds, questions = num.shape
    resamples = seed_idx.shape[0]
    seed_counts = np.zeros((resamples, seeds))
    np.add.at(seed_counts, (np.arange(resamples)[:, None], seed_idx), 1.0)
    q_counts = np.zeros((resamples, questions))
    np.add.at(q_counts, (np.arange(resamples)[:, None], q_idx), 1.0)
    top = np.einsum("rs,sq,rq->r", seed_counts, num, q_counts)
    bottom = np.einsum("rs,sq,rq->r", seed_counts, den, q_counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return top / bottom


def _check(num: np.ndarray, den: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    num = np.asarray(num, dtype=float)
    if num.ndim != 2 or min(num.shape) < 1:
        raise ValueError(f"scores must be a [seeds, questions] grid, got shape {num.shape}")
    den = np.ones_like(num) if den is None else np.asarray(den, dtype=float)
    if den.shape != num.shape:
        raise ValueError(f"denominator shape {den.shape} != scores shape {num.shape}")
    return np.nan_to_num(num), den


def bootstrap_interval(
    scores: np.ndarray, counts: np.ndarray | None = None, *, resamples: int = 2000, confidence: float = 0.95,
    seed: int = 0,
) -> Interval:
    """Score over a ``[S, Q]`` grid (seeds × questions) with its seeds × questions bootstrap interval.

    Args:
        scores: ``[S, Q]`` per seed and question (the numerator of a ratio when ``counts`` is given).
        counts: ``[S, Q]`` denominators (``None``: 1 each, i.e. the mean of ``scores``).
    """
    num, den = _check(scores, counts)
    point = float(num.sum() / den.sum()) if den.sum() else math.nan
    reps = _replicates(num, den, *_draws(num.shape, resamples, seed))
    alpha = (1.0 - confidence) / 2
    low, high = np.nanquantile(reps, [alpha, 1 - alpha]) if np.isfinite(reps).any() else (math.nan, math.nan)
    return Interval(point, float(low), float(high), confidence)


def paired_difference(
    scores_a: np.ndarray, scores_b: np.ndarray, counts_a: np.ndarray | None = None, counts_b: np.ndarray | None = None,
    *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0,
) -> PairedDifference:
    """``score(B) − score(A)`` on paired ``[S, Q]`` grids, with the same seeds × questions draws for both.

    Returns the point difference, its percentile interval, the bootstrap standard error, the share
    of replicates with a difference ≤ 0, and the minimum detectable difference
    ``(z_{1−α/2} + z_{0.8}) · SE``.
    """
    num_a, den_a = _check(scores_a, counts_a)
    num_b, den_b = _check(scores_b, counts_b)
    if num_a.shape != num_b.shape:
        raise ValueError(f"paired grids differ in shape: {num_a.shape} vs {num_b.shape}")
    draws = _draws(num_a.shape, resamples, seed)
    diffs = _replicates(num_b, den_b, *draws) - _replicates(num_a, den_a, *draws)
    diffs = diffs[np.isfinite(diffs)]
    point = float(num_b.sum() / den_b.sum() - num_a.sum() / den_a.sum())
    if diffs.size == 0:
        return PairedDifference(point, math.nan, math.nan, confidence, math.nan, math.nan, math.nan)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    std_error = float(diffs.std(ddof=1)) if diffs.size > 1 else math.nan
    z = _normal_quantile(1 - alpha)
    return PairedDifference(point, float(low), float(high), confidence, std_error,
                            float(np.mean(diffs <= 0.0)), (z + _Z_POWER_80) * std_error)


def _normal_quantile(p: float) -> float:
    """Standard normal quantile."""
    return NormalDist().inv_cdf(p)


@dataclass(frozen=True)
class SeedInterval(Interval):
    """A paired t interval over seed means (``df = seeds − 1``): with few seeds it is wider than the
    seeds × questions bootstrap, which draws only from the seeds it was given."""

    std_error: float
    df: int


def paired_t_interval(seed_means_a: np.ndarray, seed_means_b: np.ndarray, *, confidence: float = 0.95) -> SeedInterval:
    """``mean(B − A)`` over seeds with its Student-t interval.

    Args:
        seed_means_a, seed_means_b: ``[S]`` per-seed scores (seed ``k`` of both is a pair); a scalar
            ``A`` (one reference model, e.g. the warm start) is broadcast.
    """
    from scipy import stats

    b = np.asarray(seed_means_b, dtype=float)
    diffs = b - np.broadcast_to(np.asarray(seed_means_a, dtype=float), b.shape)
    point = float(diffs.mean()) if diffs.size else math.nan
    if diffs.size < 2:
        return SeedInterval(point, math.nan, math.nan, confidence, math.nan, max(diffs.size - 1, 0))
    se = float(diffs.std(ddof=1) / math.sqrt(diffs.size))
    half = float(stats.t.ppf(0.5 + confidence / 2, diffs.size - 1)) * se
    return SeedInterval(point, point - half, point + half, confidence, se, diffs.size - 1)


def wider(a: Interval, b: Interval) -> Interval:
    """The wider of two intervals of the same quantity (the one a conclusion is drawn from)."""
    width = [x.high - x.low if math.isfinite(x.high - x.low) else math.inf for x in (a, b)]
    return a if width[0] >= width[1] else b


@dataclass(frozen=True)
class DesignNeeds:
    """What a paired design needs to detect ``target`` (power 0.8, two-sided ``1 − confidence``)."""

    target: float
    detectable_now: float
    seeds_at_current_questions: int | None
    seeds_at_max_questions: int | None
    max_questions: int


def design_needs(diffs: np.ndarray, target: float, *, max_questions: int, confidence: float = 0.95,
                 max_seeds: int = 200) -> DesignNeeds:
    """Seeds (at the current and at ``max_questions`` questions) a paired design needs to detect ``target``.

    ``diffs`` is the ``[S, Q]`` grid of paired per-question differences B − A. Its seed means vary by
    the seed-to-seed variance ``σ²_seed`` plus the question noise ``σ²_q / Q`` (``σ²_q``: the variance
    of a difference over questions within a seed), so the paired t test's detectable difference with
    ``S`` seeds and ``Q`` questions is ``(t_{1−α/2,S−1} + t_{0.8,S−1}) · √((σ²_seed + σ²_q/Q) / S)``.
    ``None``: more than ``max_seeds`` seeds (or no estimate with fewer than 2 seeds).
    """
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    seeds, questions = d.shape
    if seeds < 2 or questions < 2:
        return DesignNeeds(target, math.nan, None, None, max_questions)
    var_q = float(d.var(axis=1, ddof=1).mean())
    var_seed = max(0.0, float(d.mean(axis=1).var(ddof=1)) - var_q / questions)

    def detectable(s: int, q: int) -> float:
        df = s - 1
        return float(stats.t.ppf(0.5 + confidence / 2, df) + stats.t.ppf(0.8, df)) * math.sqrt((var_seed + var_q / q) / s)

    def needed(q: int) -> int | None:
        return next((s for s in range(2, max_seeds + 1) if detectable(s, q) <= target), None)

    return DesignNeeds(target, detectable(seeds, questions), needed(questions), needed(max_questions), max_questions)
