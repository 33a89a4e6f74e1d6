"""Native batch layout, rewards and advantages of every method, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from native_toy import toy_batch, toy_trajectory

from spader_pipeline.algorithms.methods import (
    CalibAdvOptions,
    GrpoOptions,
    SpaOptions,
    TspoOptions,
    reward_config_from_mapping,
)
from spader_pipeline.native.batch import build_batch, compute_advantages

S = 1 / math.sqrt(2)  # GRPO advantage of a two-member group with different scores


def _run(batch, method, options, *, global_step=1, **reward):
    return compute_advantages(
        batch, method, global_step=global_step, reward=reward_config_from_mapping(method, reward), options=options
    )


def test_build_batch_lays_out_tokens_scores_answers_and_finds_entities_in_retrieved_text_only():
    batch = toy_batch()
    assert batch.input_ids.shape == (4, 3 + 7) and batch.response_mask.shape == (4, 7)
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert batch.prompt_lengths.tolist() == [3, 3, 2, 2]
    assert batch.rewards.f1.tolist() == pytest.approx([2 / 3, 2 / 3, 0.0, 1.0])
    assert batch.rewards.exact_match.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert batch.rewards.format_ok.tolist() == [True, True, False, True]
    assert batch.rewards.found[:, 0].sum(dim=-1).tolist() == [1, 0, 0, 2]
    assert batch.rewards.query_counts[:, 0].tolist() == [1, 1, 0, 1]


def test_build_batch_matches_each_retrieved_document_separately():
    """A step's documents are matched one by one: an alias never spans two documents."""
    gt = [["New York"], ["Lagos"]]
    trajs = [
        toy_trajectory([1], [([5], [6]), ([7], [])], ("Lagos",), [["born in New", "York is big, Lagos too"]]),
        toy_trajectory([1], [([5], [6]), ([7], [])], ("Lagos",), [["New York and Lagos"]]),
    ]
    batch = build_batch(trajs, [{"uid": "a", "ground_truth": gt}] * 2, pad_id=0)
    assert batch.rewards.found[:, 0].tolist() == [[False, True], [True, True]]


def test_grpo_equals_verl_estimator_on_the_outcome():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    batch = toy_batch()
    grpo = _run(batch, "grpo", GrpoOptions())
    assert grpo.returns.tolist() == pytest.approx([2 / 3, 2 / 3, 0.0, 1.0])
    expected, _ = compute_grpo_outcome_advantage(grpo.token_rewards, batch.response_mask, batch.uids)
    assert torch.allclose(grpo.advantages, expected)
    assert grpo.discovery.tolist() == [0.0] * 4


def test_spader_pays_for_discoveries():
    batch = toy_batch()
    spader = _run(batch, "spader", SpaOptions(gamma=0.9), cost_free_steps=0)
    assert spader.discovery[0] > 0 and spader.discovery[1] == 0  # same answer F1, only traj 0 retrieved gold
    assert spader.advantages[0, 0] > spader.advantages[1, 0]
    assert (spader.advantages * (1 - batch.response_mask)).abs().sum() == 0


def test_tspo_hand_computed():
    """Group a: both EM 0 (homogeneous) → only the turn term on the retrieval stage; group b mixed."""
    batch = toy_batch()
    out = _run(batch, "tspo", TspoOptions(latent_reward=0.5))
    assert out.returns.tolist() == [0.0, 0.0, 0.0, 1.0]  # exact match, not F1
    # latent reward on the first-occurrence step's anchor, outcome on the answer's
    assert out.token_rewards[0].tolist() == [0, 0.5, 0, 0, 0, 0, 0]
    assert out.token_rewards[3].tolist() == [0, 0, 0.5, 0, 1.0, 0, 0]
    expected = torch.tensor([
        [S, S, 0, 0, 0, 0, 0],  # k* = 0: turn term +; answer stage 0 (homogeneous group)
        [-S, -S, 0, 0, 0, 0, 0],  # no k*: every search step gets the turn term
        [-S, 0, 0, 0, 0, 0, 0],  # mixed group, no k*: trajectory term only
        [2 * S, 2 * S, 2 * S, 0, S, 0, 0],  # mixed, k* = 0: trajectory + turn term up to k*
    ])
    torch.testing.assert_close(out.advantages, expected, atol=1e-4, rtol=0)


def _calibadv_batch():
    gt = [["Ghana"], ["Mali"]]
    trajs = [
        # A: correct; its documents X, Z are the silver set. 2 answer tokens.
        toy_trajectory([1], [([2], [9]), ([3], [9]), ([4, 4], [])], ("Ghana", "Mali"), ["X", "Z"],
                       thinks=["find countries", "look for mali", "done"]),
        # B: wrong, but its search found new silver document X → that turn's penalty is removed
        toy_trajectory([1], [([2], [9]), ([4], [])], ("Togo",), ["X"], thinks=["alpha beta", "done"]),
        # C: wrong, non-silver document → full penalty
        toy_trajectory([1], [([2], [9]), ([4], [])], ("Togo",), ["Y"], thinks=["foo", "done"]),
        # D: wrong; its second search finds silver Z but repeats the first turn's reasoning → voided
        toy_trajectory([1], [([2], [9]), ([3], [9]), ([4], [])], ("Togo",), ["Y", "Z"],
                       thinks=["same words here", "same words here", "done"]),
    ]
    return build_batch(trajs, [{"uid": "g", "ground_truth": gt}] * 4, pad_id=0)


def test_calibadv_hand_computed_honours_think_similarity():
    batch = _calibadv_batch()
    out = _run(batch, "calibadv", CalibAdvOptions())
    # GRPO on [1, 0, 0, 0]: mean 0.25, std 0.5 → [1.5, -0.5, -0.5, -0.5]; A's two positive answer tokens
    # (P = 3) are rebalanced against the negative answer mass (N = -1.5): ×0.5.
    expected = torch.tensor([
        [1.5, 0, 1.5, 0, 0.75, 0.75],
        [0.0, 0, -0.5, 0, 0, 0],
        [-0.5, 0, -0.5, 0, 0, 0],
        [-0.5, 0, -0.5, 0, -0.5, 0],
    ])
    torch.testing.assert_close(out.advantages, expected, atol=1e-4, rtol=0)
    # step scores travel on the search steps' anchors, the outcome on the answer's
    assert out.token_rewards[1].tolist() == pytest.approx([1.0, 0, 0, 0, 0, 0])
    assert out.token_rewards[3, 2].item() == pytest.approx(1e-6)  # voided: "evaluated, not correct"

    lenient = _run(batch, "calibadv", CalibAdvOptions(think_similarity=1.0))  # no turn is "similar"
    assert lenient.advantages[3].tolist() == pytest.approx([-0.5, 0, 0.0, 0, -0.5, 0], abs=1e-4)


def test_calibadv_max_repeated_docs_voids_a_turn():
    gt = [["Ghana"]]
    trajs = [
        toy_trajectory([1], [([2], [9]), ([3], [9]), ([4], [])], ("Ghana",), ["X", "Z"], thinks=["a", "b", "c"]),
        toy_trajectory([1], [([2], [9]), ([3], [9]), ([4], [])], ("Togo",), ["Z", ["Z", "X"]],
                       thinks=["d e", "f g", "h"]),
    ]
    batch = build_batch(trajs, [{"uid": "g", "ground_truth": gt}] * 2, pad_id=0)
    # B's second turn repeats one earlier document and brings one new silver document (X)
    kept = _run(batch, "calibadv", CalibAdvOptions(max_repeated_docs=1))
    voided = _run(batch, "calibadv", CalibAdvOptions(max_repeated_docs=0))
    assert kept.token_rewards[1, 0].item() == pytest.approx(1.0)  # new silver document Z
    assert kept.token_rewards[1, 2].item() == pytest.approx(0.5)  # 1 new silver of 2 documents
    assert voided.token_rewards[1, 2].item() == pytest.approx(1e-6)  # the repeat voids the turn
    # B is negative (A = -1/√2): the soft penalty keeps (1 − q) of it on that turn
    assert kept.advantages[1, 2].item() == pytest.approx(-S * 0.5, abs=1e-4)
    assert voided.advantages[1, 2].item() == pytest.approx(-S, abs=1e-4)


@pytest.mark.parametrize(
    ("method", "options"),
    [("grpo", GrpoOptions()), ("spader", SpaOptions()), ("calibadv", CalibAdvOptions()), ("tspo", TspoOptions())],
)
def test_tool_cost_is_a_per_method_setting_following_the_global_step(method, options):
    """Issue 9.6: every method pays the cost it is configured with, from the real global step."""
    batch = toy_batch()
    schedule = {"cost_free_steps": 10, "cost_rampup_steps": 10}
    free = _run(batch, method, options, global_step=15, tool_round_cost=0.0, **schedule)
    before = _run(batch, method, options, global_step=5, tool_round_cost=0.5, **schedule)
    during = _run(batch, method, options, global_step=15, tool_round_cost=0.5, **schedule)
    assert free.cost_coefficient == 0.0 and before.cost_coefficient == 0.0
    assert during.cost_coefficient == pytest.approx(0.25)
    torch.testing.assert_close(before.returns, free.returns)
    # c_eff · queries / |GT| = 0.25 · 1 / 2 for each trajectory that searched once
    torch.testing.assert_close(free.returns - during.returns, torch.tensor([0.125, 0.125, 0.0, 0.125]))
    assert reward_config_from_mapping(method, {}).tool_round_cost == (0.01 if method == "spader" else 0.0)


def test_reward_inputs_have_one_construction_for_both_trainers():
    """``RewardInputs.from_steps`` takes the native batch's found tensor or the verl payloads' per-step
    entity indices (rows longer than the step layout cut, an unplaceable row empty): the same inputs."""
    import torch

    from spader_pipeline.algorithms.methods import RewardInputs

    found = torch.zeros((3, 2, 3), dtype=torch.bool)
    found[0, 0, 1] = found[0, 1, 2] = found[2, 1, 0] = True
    common = {"f1": [0.5, 0.0, 1.0], "exact_match": [0.0, 0.0, 1.0], "format_ok": [True, False, True],
              "num_gt": [3, 1, 2], "query_counts": [[2, 1], [], [1, 1, 5]]}
    native = RewardInputs.from_steps(found=found, **common)
    verl = RewardInputs.from_steps(found=[[[1], [2]], [], [[], [0], [1]]], steps=2, **common)
    for name in ("f1", "exact_match", "format_ok", "found", "num_gt", "query_counts"):
        left, right = getattr(native, name), getattr(verl, name)
        assert left.dtype == right.dtype and torch.equal(left, right), name
    assert native.query_counts.tolist() == [[2.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
