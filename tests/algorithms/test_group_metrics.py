"""Group-diversity and advantage-agreement metrics (algorithms/group_metrics.py)."""

from __future__ import annotations

import math

import pytest
import torch

from spader_pipeline.algorithms.group_metrics import advantage_agreement, group_diversity, normalise_query


def _search(*queries: str):
    return ("search", tuple(normalise_query(q) for q in queries))


def _answer(*answers: str):
    return ("answer", tuple(answers))


def test_identical_group_never_diverges_and_union_equals_mean():
    acts = [[_search("mel brooks films"), _answer("a")]] * 3
    found = torch.zeros((3, 2, 4), dtype=torch.bool)
    found[:, 0, :2] = True
    out = group_diversity(["q"] * 3, acts, [["d1", "d2"]] * 3, found, torch.tensor([4, 4, 4]))
    assert out["group/distinct_query_seqs"] == 1 and out["group/diverse_frac"] == 0
    assert out["group/distinct_docs"] == 2
    assert out["group/entity_recall_union"] == pytest.approx(0.5) == out["group/entity_recall_mean"]
    assert math.isnan(out["group/first_divergence_turn"]) and out["group/identical_frac"] == 1


def test_diverse_group_union_exceeds_mean_and_divergence_turn():
    acts = [
        [_search("Mel Brooks films"), _search("Mel Brooks director"), _answer("a")],
        [_search("mel  brooks FILMS"), _search("Young Frankenstein"), _answer("a")],  # same first query
    ]
    found = torch.zeros((2, 3, 4), dtype=torch.bool)
    found[0, 1, 0] = True
    found[1, 1, 1] = True
    found[1, 0, 0] = True
    out = group_diversity(["q", "q"], acts, [["d1", "d2"], ["d1", "d3"]], found, torch.tensor([4, 4]))
    assert out["group/distinct_query_seqs"] == 2 and out["group/diverse_frac"] == 1
    assert out["group/distinct_docs"] == 3
    assert out["group/first_divergence_turn"] == 2 and out["group/identical_frac"] == 0
    assert out["group/entity_recall_union"] == pytest.approx(0.5)
    assert out["group/entity_recall_mean"] == pytest.approx((0.25 + 0.5) / 2)


def test_groups_are_averaged_and_lengths_checked():
    acts = [[_search("x")], [_search("y")], [_search("z")], [_search("z")]]
    found = torch.zeros((4, 1, 1), dtype=torch.bool)
    out = group_diversity([0, 0, 1, 1], acts, [[], [], [], []], found, torch.tensor([1, 1, 1, 1]))
    assert out["group/distinct_query_seqs"] == 1.5 and out["group/diverse_frac"] == 0.5
    assert out["group/first_divergence_turn"] == 1 and out["group/identical_frac"] == 0.5
    with pytest.raises(ValueError, match="lengths differ"):
        group_diversity([0], acts, [[]], found, torch.tensor([1]))


def test_shorter_trajectory_diverges_where_it_stops():
    acts = [[_search("x"), _search("y")], [_search("x")]]
    found = torch.zeros((2, 2, 1), dtype=torch.bool)
    out = group_diversity([0, 0], acts, [[], []], found, torch.tensor([1, 1]))
    assert out["group/first_divergence_turn"] == 2


def test_advantage_agreement_identity_scale_and_masking():
    torch.manual_seed(0)
    grpo = torch.randn(4, 6)
    mask = torch.ones(4, 6)
    mask[:, 4:] = 0
    same = advantage_agreement(grpo, grpo, mask)
    assert same["adv/corr_vs_grpo"] == pytest.approx(1.0) and same["adv/rel_l2_vs_grpo"] == pytest.approx(0.0)
    assert same["adv/zero_frac"] == same["adv/grpo_zero_frac"] == 0.0
    scaled = advantage_agreement(2 * grpo, grpo, mask)
    assert scaled["adv/corr_vs_grpo"] == pytest.approx(1.0) and scaled["adv/rel_l2_vs_grpo"] == pytest.approx(1.0)
    garbage_off_mask = grpo.clone()
    garbage_off_mask[:, 4:] = 100.0
    assert advantage_agreement(garbage_off_mask, grpo, mask)["adv/corr_vs_grpo"] == pytest.approx(1.0)
    opposite = advantage_agreement(-grpo, grpo, mask)
    assert opposite["adv/corr_vs_grpo"] == pytest.approx(-1.0) and opposite["adv/rel_l2_vs_grpo"] == pytest.approx(2.0)


def test_advantage_agreement_undefined_cases_are_nan():
    zeros = torch.zeros(2, 3)
    out = advantage_agreement(torch.ones(2, 3), zeros, torch.ones(2, 3))
    assert math.isnan(out["adv/corr_vs_grpo"]) and math.isnan(out["adv/rel_l2_vs_grpo"])
    # ... but the share of tokens without gradient says how far apart the two updates are
    assert out["adv/grpo_zero_frac"] == 1.0 and out["adv/zero_frac"] == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        advantage_agreement(torch.ones(2, 3), torch.ones(2, 4), torch.ones(2, 3))


def test_comparison_advantages_are_grpo_on_the_same_batch():
    from spader_pipeline.algorithms.group_metrics import comparison_advantages
    from spader_pipeline.algorithms.methods import (
        GrpoOptions,
        RewardInputs,
        method_advantages,
        method_rewards,
        reward_config_from_mapping,
    )

    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 1, 0], [1, 1, 0, 1, 1, 1]]).float()
    inputs = RewardInputs(
        f1=torch.tensor([1.0, 0.0, 0.5, 0.25]), exact_match=torch.tensor([1.0, 0.0, 0.0, 0.0]),
        format_ok=torch.tensor([True, True, True, False]), found=torch.zeros((4, 2, 3), dtype=torch.bool),
        num_gt=torch.tensor([3, 3, 3, 3]), query_counts=torch.ones((4, 2)),
    )
    index = ["a", "a", "b", "b"]
    spader_reward = reward_config_from_mapping("spader", {})  # tool cost 0.01: GRPO's own (0) replaces it
    got = comparison_advantages(mask, index, inputs, global_step=500, reward=spader_reward)
    grpo_reward = reward_config_from_mapping("grpo", {})
    tokens = method_rewards("grpo", mask, index, inputs, global_step=500, reward=grpo_reward, options=GrpoOptions())
    expected, _ = method_advantages("grpo", tokens.token_rewards, mask, index, GrpoOptions())
    torch.testing.assert_close(got, expected)
    assert advantage_agreement(got, expected, mask)["adv/corr_vs_grpo"] == pytest.approx(1.0)
