"""Adding a method is one definition: a toy fifth method, defined here and nowhere else, trains with
both trainers — the native one and verl's own ``RayPPOTrainer.fit()`` — without edits elsewhere: no
overlay file, its verl settings come from the registry (:mod:`spader_pipeline.verl_plugin.method_configs`).

The toy method (the worked example of docs/algorithms.md, "Adding a method"): the shared outcome
term on the answer step (as GRPO), and REINFORCE with the group-mean baseline as its estimator,
``A_i = scale · (R_i − mean_group R)`` on every model token, under the estimator name
``toy_baseline``. It is registered only while a test needs it (:func:`registered`), so the global
registry other tests see holds the four project methods. verl's Ray workers, which score the
rewards in their own processes, import this module through ``VERL_USE_EXTERNAL_MODULES`` (as a
user's own method module would be) and register it there.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from spader_pipeline.algorithms.advantages._groups import group_index
from spader_pipeline.algorithms.methods import (
    Method,
    MethodRewards,
    get_method,
    method_advantages,
    method_names,
    register_method,
    registered,
    split_outcome_and_steps,
)
from spader_pipeline.algorithms.methods.base import cost_coefficient, outcome, place_on_anchors

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER_FLAG = "SPADER_TEST_REGISTER_TOY"  # set only in the Ray workers of the verl run below


# ----------------------------------------------------------------------------------- the method


@dataclass(frozen=True)
class ToyOptions:
    """The toy method's options."""

    scale: float = 1.0
    """multiplies the advantage"""


def toy_rewards(mask, index, inputs, *, global_step, reward, options, layout) -> MethodRewards:
    """The outcome (F1, format penalty, tool cost on the outcome) on the answer step's last token."""
    c_eff = cost_coefficient(global_step, reward)
    final = outcome(inputs.f1, inputs, reward, c_eff)
    token = place_on_anchors(torch.zeros((mask.shape[0], layout.max_steps)), final, layout, mask.shape[1])
    return MethodRewards(token, final, torch.zeros_like(final), c_eff)


CALLS: list[int] = []  # batch sizes the estimator saw (in this process)


def toy_advantage(rewards, mask, index, options: ToyOptions, layout):
    """``scale · (R_i − mean_group R)`` broadcast over the model tokens."""
    CALLS.append(rewards.shape[0])
    final, _, layout = split_outcome_and_steps(rewards, mask, layout)
    groups = group_index(index)
    adv = options.scale * (final - groups.mean(final))
    token = adv.unsqueeze(1) * mask.float()
    return token, token


TOY = Method("toy", "toy_baseline", ToyOptions, toy_rewards, toy_advantage, paper="REINFORCE, group-mean baseline")

if os.environ.get(WORKER_FLAG) == "1":  # a verl worker of the run below
    register_method(TOY)


@pytest.fixture
def toy():
    assert "toy" not in method_names()
    with registered(TOY) as method:
        yield method
    assert "toy" not in method_names()


# ----------------------------------------------------------------------------------- the tests


def test_the_toy_method_is_registered_only_inside_the_block(toy):
    assert get_method("toy") is TOY and method_names()[-1] == "toy"
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.float32)
    rewards = torch.zeros(4, 4)
    rewards[0, 3], rewards[1, 0], rewards[2, 3], rewards[3, 1] = 1.0, 0.0, 0.5, 0.5
    adv, _ = method_advantages("toy", rewards, mask, ["a", "a", "b", "b"], ToyOptions(scale=2.0))
    assert adv[0].tolist() == [1.0, 1.0, 0.0, 1.0] and adv[1].tolist() == [-1.0, 0.0, 0.0, 0.0]
    assert adv[2].abs().sum() == 0 and adv[3].abs().sum() == 0


@pytest.fixture(scope="module")
def loop():
    """The trainer-loop test's helpers, imported here only (verl's workers import this module too)."""
    pytest.importorskip("verl")
    sys.path.insert(0, str(ROOT / "tests" / "verl_plugin"))
    import test_verl_trainer_loop

    return test_verl_trainer_loop


@pytest.fixture(scope="module")
def workspace(loop, tmp_path_factory):
    with loop.trainer_loop_workspace(tmp_path_factory.mktemp("toy-loop")) as ws:
        yield ws


@pytest.mark.slow
def test_native_trainer_trains_the_toy_method(toy, loop, workspace, tmp_path):
    from spader_pipeline.native import NativeTrainerConfig, train_native
    from spader_pipeline.native.checkpoint import latest_checkpoint, load_trainer_state
    from spader_pipeline.retrieval import load_retriever
    from spader_pipeline.retrieval.service import LocalSearch

    config = NativeTrainerConfig(
        method="toy", options={"scale": 2.0}, reward={"tool_round_cost": 0.0}, total_steps=2, prompts_per_step=2,
        group_size=2, micro_batch_size=2, rollout={"max_turns": 2, "max_response_tokens": 600}, max_new_tokens=10,
        checkpoint_every=1, log_samples_every=0,
    )
    samples = [{"id": i, "question": q, "ground_truth": gt} for split, i, q, gt in loop.QUESTIONS if split == "train"]
    logged = []
    CALLS.clear()
    result = train_native(
        config, model_path=workspace["model"], samples=samples,
        search=LocalSearch(load_retriever(workspace["root"] / "bm25")), run_dir=tmp_path,
        prompt_template=loop._template(), log_metrics=lambda m, s: logged.append(dict(m)),
    )
    assert result.steps == 2 and CALLS == [4, 4]  # the toy estimator ran on each step's 2 × 2 rollouts
    assert {"method_reward/mean", "adv/std"} <= set(logged[-1])
    assert load_trainer_state(latest_checkpoint(tmp_path)[1])["extra"]["method"] == "toy"


@pytest.mark.slow
def test_verl_trainer_loop_trains_the_toy_method(toy, loop, workspace, tmp_path):
    import spader_pipeline.verl_plugin  # noqa: F401  (registers the estimators: the toy's too)

    block = {"method": "toy", "reward": {"tool_round_cost": 0.0}, "options": {"scale": 2.0}}
    with loop.ray_for_trainer_loop(workspace["model"], paths=[HERE], modules=[Path(__file__).stem],
                                   env={WORKER_FLAG: "1"}):
        metrics, config = loop.run_trainer_loop("toy", workspace, tmp_path / "run", block=block)
        calls = list(loop.RecordingWorkerGroup.calls)
    assert config.algorithm.adv_estimator == "toy_baseline" and config.algorithm.toy_baseline.scale == 2.0
    assert [m["step"] for m in metrics] == [0, 1, 2]
    updates = [td for name, td in calls if name == "update_actor"]
    assert len(updates) == 2
    for td in updates:
        rewards, mask = td["token_level_rewards"], td["response_mask"]
        assert ((rewards != 0).sum(dim=1) <= 1).all()  # the outcome only, on the answer step
        uids = list(loop._non_tensor(td, "uid"))
        expected, _ = method_advantages("toy", rewards, mask, uids, ToyOptions(scale=2.0))
        torch.testing.assert_close(td["advantages"], expected)
        assert torch.any(td["advantages"] != 0)
