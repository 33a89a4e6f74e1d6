"""Adding a method is one definition: the toy fifth method of :mod:`toy_method`, defined there and
nowhere else, is registered by name and trains with the native trainer without edits elsewhere.
Its run through verl's own ``RayPPOTrainer.fit()`` (its verl settings from the registry
(:mod:`spader_pipeline.verl_plugin.method_configs`), no overlay file) is
``test_verl_trainer_loop.py::test_a_method_defined_outside_the_project_trains_through_fit``: it
shares the four project methods' Ray session there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from spader_pipeline.algorithms.methods import get_method, method_advantages, method_names, registered

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from toy_method import CALLS, TOY, ToyOptions  # noqa: E402


@pytest.fixture
def toy():
    assert "toy" not in method_names()
    with registered(TOY) as method:
        yield method
    assert "toy" not in method_names()


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
    """The trainer-loop test's helpers (its workspace), imported only where verl is installed."""
    pytest.importorskip("verl")
    sys.path.insert(0, str(ROOT / "tests" / "verl_plugin"))
    import verl_loop_support

    return verl_loop_support


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
        prompt_template=loop.template(), log_metrics=lambda m, s: logged.append(dict(m)),
    )
    assert result.steps == 2 and CALLS == [4, 4]  # the toy estimator ran on each step's 2 × 2 rollouts
    assert {"method_reward/mean", "adv/std"} <= set(logged[-1])
    assert load_trainer_state(latest_checkpoint(tmp_path)[1])["extra"]["method"] == "toy"
