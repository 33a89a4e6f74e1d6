"""Seeds × questions bootstrap of ``make compare`` (spader_pipeline.evaluation.bootstrap)."""

import numpy as np
import pytest

from spader_pipeline.evaluation.bootstrap import _draws, _replicates, bootstrap_interval, paired_difference


def test_replicates_equal_the_straightforward_resampling():
    rng = np.random.default_rng(3)
    num, den = rng.random((3, 7)), rng.integers(0, 4, (3, 7)).astype(float)
    seed_idx, q_idx = _draws(num.shape, 50, seed=1)
    fast = _replicates(num, den, seed_idx, q_idx)
    for r in range(50):
        grid_num = num[seed_idx[r]][:, q_idx[r]]
        grid_den = den[seed_idx[r]][:, q_idx[r]]
        assert fast[r] == pytest.approx(grid_num.sum() / grid_den.sum())


def test_constant_scores_give_a_point_interval():
    interval = bootstrap_interval(np.full((3, 20), 0.25), resamples=200)
    assert interval.mean == interval.low == interval.high == pytest.approx(0.25)


def test_counts_make_a_micro_average():
    hits, totals = np.array([[1.0, 0.0, 3.0]]), np.array([[2.0, 0.0, 3.0]])
    assert bootstrap_interval(hits, totals, resamples=100).mean == pytest.approx(4 / 5)


def test_identical_methods_differ_by_zero():
    scores = np.random.default_rng(0).random((3, 40))
    diff = paired_difference(scores, scores.copy(), resamples=300)
    assert diff.mean == diff.low == diff.high == 0.0 and diff.contains_zero
    assert diff.detectable == 0.0


def test_a_clear_improvement_excludes_zero_and_noise_does_not():
    rng = np.random.default_rng(1)
    a = rng.random((3, 200))
    better = paired_difference(a, np.clip(a + 0.1 + 0.05 * rng.standard_normal(a.shape), 0, None), resamples=500)
    assert better.low > 0 and not better.contains_zero and better.p_not_better < 0.01
    assert 0 < better.detectable < 0.1
    noise = paired_difference(a, a + 0.02 * rng.standard_normal(a.shape), resamples=500)
    assert noise.contains_zero


def test_paired_is_tighter_than_unpaired_when_questions_dominate():
    rng = np.random.default_rng(2)
    hardness = rng.random(150)
    a = np.tile(hardness, (3, 1)) + 0.01 * rng.standard_normal((3, 150))
    b = a + 0.02
    diff = paired_difference(a, b, resamples=500)
    width_a = bootstrap_interval(a, resamples=500)
    assert diff.high - diff.low < (width_a.high - width_a.low) / 5


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="seeds, questions"):
        bootstrap_interval(np.zeros(5))
    with pytest.raises(ValueError, match="differ in shape"):
        paired_difference(np.zeros((2, 5)), np.zeros((3, 5)))


def test_paired_t_interval_over_seed_means_matches_the_textbook_formula():
    from scipy import stats

    from spader_pipeline.evaluation.bootstrap import paired_t_interval

    a, b = np.array([0.070, 0.080, 0.090]), np.array([0.083, 0.090, 0.077])  # differences +0.013, +0.010, -0.013
    out = paired_t_interval(a, b)
    d = b - a
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    assert out.df == 2 and out.mean == pytest.approx(d.mean())
    assert (out.low, out.high) == pytest.approx((d.mean() - half, d.mean() + half))
    # against one reference model (the warm start): the scalar is broadcast over the seeds
    assert paired_t_interval(0.07, b).mean == pytest.approx(b.mean() - 0.07)
    assert np.isnan(paired_t_interval([0.1], [0.2]).low)  # one seed: no interval


def test_with_three_seeds_the_t_interval_is_the_wider_and_the_conclusion_comes_from_it():
    from spader_pipeline.evaluation.bootstrap import paired_t_interval, wider

    rng = np.random.default_rng(0)
    base = rng.uniform(0, 0.3, size=(3, 100))
    shift = np.array([[0.013], [0.010], [-0.013]])
    boot = paired_difference(base, base + shift, resamples=2000)
    t = paired_t_interval(base.mean(axis=1), (base + shift).mean(axis=1))
    assert t.high - t.low > boot.high - boot.low
    assert wider(boot, t) is t


def test_design_needs_more_seeds_for_a_smaller_target_and_fewer_with_more_questions():
    from spader_pipeline.evaluation.bootstrap import design_needs

    rng = np.random.default_rng(1)
    seed_effect = rng.normal(0.0, 0.01, size=(3, 1))
    diffs = seed_effect + rng.normal(0.0, 0.2, size=(3, 100))
    big, small = design_needs(diffs, 0.05, max_questions=240), design_needs(diffs, 0.02, max_questions=240)
    assert small.seeds_at_current_questions is None or small.seeds_at_current_questions >= (big.seeds_at_current_questions or 0)
    assert (small.seeds_at_max_questions or 10**6) <= (small.seeds_at_current_questions or 10**6)
    assert big.detectable_now > 0
