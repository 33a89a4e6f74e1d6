"""Step segmentation and the advantage estimators (SPA, GRPO, CalibAdv, TSPO)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference_loops import loop_spa, loop_steps

from spader_pipeline.algorithms.advantages import (
    NOT_CORRECT,
    calibadv_advantage,
    calibadv_step_scores,
    grpo_outcome_advantage,
    spa_advantage,
    tspo_advantage,
    word_similarity,
)
from spader_pipeline.algorithms.steps import (
    gather_steps,
    scatter_to_anchors,
    segment_steps,
    spread_over_steps,
)


def _mask(rows: list[list[tuple[int, int]]], length: int) -> torch.Tensor:
    m = torch.zeros(len(rows), length, dtype=torch.long)
    for i, spans in enumerate(rows):
        for a, b in spans:
            m[i, a:b] = 1
    return m


# ------------------------------------------------------------------ steps


def test_segment_steps_basic():
    m = _mask([[(0, 3), (5, 7), (9, 10)], [], [(2, 4)], [(0, 12)]], 12)
    lay = segment_steps(m)
    assert lay.num_steps.tolist() == [3, 0, 1, 1]
    assert lay.anchors.tolist() == [[2, 6, 9], [0, 0, 0], [3, 0, 0], [11, 0, 0]]
    assert lay.starts.tolist() == [[0, 5, 9], [0, 0, 0], [2, 0, 0], [0, 0, 0]]
    assert lay.step_mask.tolist() == [[True] * 3, [False] * 3, [True, False, False], [True, False, False]]
    assert lay.last_anchor.tolist() == [9, -1, 3, 11]
    assert lay.step_index[0].tolist() == [0, 0, 0, -1, -1, 1, 1, -1, -1, 2, -1, -1]


def test_segment_steps_empty_batch_and_width():
    lay = segment_steps(torch.zeros(2, 5))
    assert lay.max_steps == 0 and lay.last_anchor.tolist() == [-1, -1]
    assert segment_steps(torch.ones(1, 4), max_steps=3).anchors.shape == (1, 3)
    with pytest.raises(ValueError):
        segment_steps(torch.ones(4))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=30), min_size=1, max_size=6))
def test_segment_steps_equals_token_loop(rows):
    width = max(len(r) for r in rows)
    m = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lay = segment_steps(m)
    for i in range(len(rows)):
        spans = loop_steps(m[i])
        assert lay.num_steps[i].item() == len(spans)
        assert lay.starts[i, : len(spans)].tolist() == [a for a, _ in spans]
        assert lay.anchors[i, : len(spans)].tolist() == [b - 1 for _, b in spans]
    vals = torch.randn(len(rows), lay.max_steps)
    tok = scatter_to_anchors(vals, lay, width)
    np.testing.assert_allclose(gather_steps(tok, lay), vals * lay.step_mask)
    spread = spread_over_steps(vals, lay)
    assert (spread[m == 0] == 0).all()


# ------------------------------------------------------------------ SPA


def _spec_vector():
    m = _mask([[(0, 2), (4, 6), (8, 10)], [(0, 3), (5, 7)], [(0, 4)]], 12)
    r = torch.zeros(3, 12)
    r[0, 1], r[0, 5], r[0, 9] = 0.5, 0.25, 0.8
    r[1, 2], r[1, 6] = 1.0, 0.4
    r[2, 3] = 0.1
    return r, m


def test_spa_spec_test_vector():
    """The SPADER reference's worked SPA vector (docs/algorithms.md): one group of 3, γ = 0.9."""
    r, m = _spec_vector()
    adv, ret = spa_advantage(r, m, ["u"] * 3, gamma=0.9)
    np.testing.assert_allclose(ret[0, [1, 5, 9]], [1.373, 0.97, 0.8], atol=1e-6)
    np.testing.assert_allclose(ret[1, [2, 6]], [1.36, 0.4], atol=1e-6)
    np.testing.assert_allclose(adv[0, [1, 5, 9]], [0.7180, 1.2897, 1.4142], atol=1e-4)
    np.testing.assert_allclose(adv[1, [2, 6]], [0.6962, -0.1424], atol=1e-4)
    np.testing.assert_allclose(adv[2, [3]], [-1.4142], atol=1e-4)
    # broadcast over the whole step, zero on observation tokens
    assert torch.all(adv[0, 0:2] == adv[0, 1]) and adv[0, 2:4].abs().sum() == 0


def test_spa_edge_cases():
    r, m = _spec_vector()
    # singleton groups → 0 everywhere
    adv, _ = spa_advantage(r, m, ["a", "b", "c"], gamma=0.9)
    assert adv.abs().max() == 0
    # no steps at all → zeros, no crash
    adv, ret = spa_advantage(torch.zeros(2, 5), torch.zeros(2, 5), ["a", "a"])
    assert adv.abs().sum() == 0 and ret.abs().sum() == 0
    # empty response among peers contributes zeros to the baseline; lone long trajectory → ±sqrt(n−1)
    m2 = _mask([[(0, 2), (4, 6)], [], [(0, 2)], [(0, 2)]], 8)
    r2 = torch.zeros(4, 8)
    r2[0, 1], r2[0, 5], r2[2, 1], r2[3, 1] = 1.0, 2.0, 1.0, 1.0
    adv, _ = spa_advantage(r2, m2, ["g"] * 4, gamma=1.0)
    assert adv[1].abs().sum() == 0
    assert adv[0, 5].item() == pytest.approx(math.sqrt(3), rel=1e-5)
    # identical returns → 0
    m3 = _mask([[(0, 2)], [(0, 2)]], 3)
    r3 = torch.zeros(2, 3)
    r3[:, 1] = 0.7
    assert spa_advantage(r3, m3, [1, 1])[0].abs().max() == 0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_groups=st.integers(1, 3),
    group_size=st.integers(1, 5),
    gamma=st.sampled_from([1.0, 0.9, 0.5]),
)
@example(seed=436, n_groups=1, group_size=2, gamma=0.5)  # Var_t near ε: float32 statistics were 2e-5 off
def test_spa_equals_reference_loop(seed, n_groups, group_size, gamma):
    g = torch.Generator().manual_seed(seed)
    bsz, length = n_groups * group_size, 24
    m = (torch.rand(bsz, length, generator=g) < 0.6).long()
    m[:, -3:] = 0  # padding
    r = torch.randn(bsz, length, generator=g) * m
    index = np.array([f"u{i // group_size}" for i in range(bsz)], dtype=object)
    adv, ret = spa_advantage(r, m, index, gamma=gamma)
    adv_ref, ret_ref = loop_spa(r, m, list(index), gamma=gamma)
    np.testing.assert_allclose(adv, adv_ref, atol=1e-5)
    np.testing.assert_allclose(ret, ret_ref, atol=1e-5)


# ------------------------------------------------------------------ GRPO


def test_grpo_core_formula():
    r = torch.zeros(5, 4)
    r[:, -1] = torch.tensor([1.0, 0, 0, 0, 3.0])
    m = torch.ones(5, 4)
    adv, _ = grpo_outcome_advantage(r, m, ["a", "a", "a", "a", "b"])
    s = torch.tensor([1.0, 0, 0, 0])
    np.testing.assert_allclose(adv[:4, 0], (s - s.mean()) / (s.std() + 1e-6), rtol=1e-6)
    assert adv[4, 0].item() == pytest.approx(3.0 / (1 + 1e-6))  # singleton: mean 0, std 1
    drgrpo, _ = grpo_outcome_advantage(r, m, ["a"] * 4 + ["b"], norm_adv_by_std=False)
    assert drgrpo[0, 0].item() == pytest.approx(0.75)


# ------------------------------------------------------------------ CalibAdv


def test_calibadv_spec_worked_example():
    """CalibAdv's worked example (arXiv 2604.18235; docs/algorithms.md): rewards [1,0,0,0,0]; a negative rollout with 2 searches, first returning 2/3 new silver docs."""
    length = 60
    rows = [[(0, 20)]] + [
        [(0, 5), (10, 15), (20, 45)]
    ] * 4  # positive: answer only (20 tok); negatives: 25-tok answers
    m = _mask(rows, length)
    outcome = torch.tensor([1.0, 0, 0, 0, 0])
    q = torch.zeros(5, 3)
    q[1, 0], q[1, 1] = 2 / 3, NOT_CORRECT
    adv, _ = calibadv_advantage(outcome, m, ["g"] * 5, q, target_ratio=1.0)
    a_neg = -0.4472136
    assert adv[1, 2].item() == pytest.approx(a_neg / 3, abs=1e-5)  # turn 0 softened to one third
    assert adv[1, 12].item() == pytest.approx(a_neg, abs=1e-5)  # turn 1 not correct → full
    assert adv[1, 30].item() == pytest.approx(a_neg, abs=1e-5)  # answer keeps full negative
    assert adv[2, 2].item() == pytest.approx(a_neg, abs=1e-5)  # not evaluated → full
    assert adv[0, 5].item() == pytest.approx(1.7888544 * 1.25, abs=1e-4)  # P=35.8, |N|=44.7 → ×1.25
    assert adv[m == 0].abs().sum() == 0


def test_calibadv_degenerate_groups_zero_answer():
    m = _mask([[(0, 2), (3, 5)], [(0, 2), (3, 5)]], 6)
    adv, _ = calibadv_advantage(torch.tensor([1.0, 1.0]), m, ["g", "g"])
    assert adv.abs().sum() == 0
    # singleton: A = r (mean 0, std 1) is positive only → answer component zeroed, search turn kept
    adv, _ = calibadv_advantage(torch.tensor([1.0]), m[:1], ["s"])
    assert adv[0, 0].item() == pytest.approx(1.0, abs=1e-5) and adv[0, 3:5].abs().sum() == 0


def test_calibadv_step_scores_silver_rules():
    docs = [
        [["d1", "d2", "d3"], ["d4", "x", "y"]],  # best qualifying rollout (r=1.0): silver = d1..d4,x,y
        [["d1", "z", "w"], ["d1", "z", "d4"]],  # turn 1 repeats 2 earlier docs → voided
        [["q", "r", "s"]],  # no silver doc
        [["d1", "d2", "d3"]],  # format invalid → not evaluated
    ]
    outcomes, fmt = [1.0, 0.2, 0.0, 0.9], [True, True, True, False]
    q = calibadv_step_scores(docs, outcomes, fmt, ["g"] * 4)
    assert q[0].tolist() == pytest.approx([1.0, 1.0])
    assert q[1].tolist() == pytest.approx([1 / 3, NOT_CORRECT])
    assert q[2].tolist() == pytest.approx([NOT_CORRECT, 0.0])
    assert q[3].tolist() == [0.0, 0.0]
    # no qualifying rollout (all < 0.7) → nothing evaluated
    assert calibadv_step_scores(docs, [0.5] * 4, [True] * 4, ["g"] * 4).abs().sum() == 0
    # near-duplicate think voids the turn
    q = calibadv_step_scores(
        [[["a"], ["b"]]], [1.0], [True], ["g"], thinks=[["look up x now", "look up x again"]]
    )
    assert q[0].tolist() == pytest.approx([1.0, NOT_CORRECT])


def test_word_similarity():
    assert word_similarity("a b c", "a b c") == 1.0
    assert word_similarity("a b c d", "a b x d") == pytest.approx(0.75)
    assert word_similarity("", "") == 1.0 and word_similarity("a", "") == 0.0


# ------------------------------------------------------------------ TSPO (proposal)


def test_tspo_composition_rules():
    m = _mask([[(0, 2), (3, 5), (6, 8)]] * 4, 9)
    k_star = torch.tensor([0, 1, -1, -1])
    # homogeneous outcomes (all 0): only the turn-level term on the retrieval stage, answer step 0
    adv, _ = tspo_advantage(torch.zeros(4), k_star, m, ["g"] * 4, latent_reward=0.5)
    lat = torch.tensor([0.5, 0.5, 0.0, 0.0])
    turn = (lat - lat.mean()) / (lat.std() + 1e-6)
    assert adv[0, 0].item() == pytest.approx(turn[0].item(), abs=1e-5) and adv[0, 3] == 0  # step 1 > k*=0
    assert adv[1, 3].item() == pytest.approx(turn[1].item(), abs=1e-5)
    assert adv[2, 0].item() == pytest.approx(turn[2].item(), abs=1e-5) and adv[2, 3] != 0  # all search steps
    assert adv[:, 6:8].abs().sum() == 0  # answer stage untouched
    # mixed outcomes: trajectory GRPO everywhere (+ turn term up to k*)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    traj = (r - r.mean()) / (r.std() + 1e-6)
    adv, _ = tspo_advantage(r, k_star, m, ["g"] * 4, add_turn_term=False)
    assert adv[:, 6].tolist() == pytest.approx(traj.tolist(), abs=1e-5)
    adv2, _ = tspo_advantage(r, k_star, m, ["g"] * 4)
    assert adv2[0, 0].item() == pytest.approx((traj[0] + turn[0]).item(), abs=1e-5)
    assert adv2[0, 6].item() == pytest.approx(traj[0].item(), abs=1e-5)
    assert adv2[2, 0].item() == pytest.approx(traj[2].item(), abs=1e-5)  # no k*: no turn term


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), group_size=st.integers(1, 6), n_groups=st.integers(1, 3))
def test_calibadv_and_tspo_reduce_to_grpo(seed, group_size, n_groups):
    """Without step scores and rebalancing CalibAdv is GRPO; TSPO on mixed groups without the turn term too."""
    g = torch.Generator().manual_seed(seed)
    bsz, length = group_size * n_groups, 16
    m = (torch.rand(bsz, length, generator=g) < 0.6).long()
    outcome = torch.randint(0, 3, (bsz,), generator=g).float() / 2
    index = [f"u{i // group_size}" for i in range(bsz)]
    r = torch.zeros(bsz, length)
    r[:, -1] = outcome
    grpo, _ = grpo_outcome_advantage(r, m, index)
    cal, _ = calibadv_advantage(outcome, m, index, None, rebalance_answer=False)
    np.testing.assert_allclose(cal, grpo, atol=1e-5)
    k_star = torch.randint(-1, 3, (bsz,), generator=g)
    tspo, _ = tspo_advantage(outcome, k_star, m, index, add_turn_term=False)
    mixed = torch.tensor(
        [len({outcome[j].item() for j in range(bsz) if index[j] == index[i]}) > 1 for i in range(bsz)]
    )
    np.testing.assert_allclose(tspo[mixed], grpo[mixed], atol=1e-5)
