"""verl learns on the CPU: the native learning test (``tests/native/test_native_learns.py``) through
verl's ``fit()`` with its real workers.

The same reward (the share of fixed-answer tokens, :mod:`fixed_answer_reward`, swapped in through verl's
reward path: the ``fixed_answer`` reward manager), the same tiny model and questions, the same shape (2
questions × 8 trajectories, one 16-token turn, 10 steps, learning rate 2e-2, no KL term, no weight decay,
fp32) and the same check: the mean over 3 seeds of ``rise`` (mean reward of the last two steps minus that
of the first two) exceeds ``MARGIN``; with the advantages zeroed (``grpo_zeroed``) or their sign flipped
(``grpo_flipped``) it stays below ``NO_LEARNING_BOUND``. Here the rollout is our decoder server, the
update verl's FSDP2 actor, the weights move through verl's checkpoint engine every step: all of it has to
work for the reward to rise.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "native"))

from native_toy import QUESTIONS, TEMPLATE, corpus_records  # noqa: E402
from test_native_learns import MARGIN, NO_LEARNING_BOUND, SEEDS, STEPS, reward_rise  # noqa: E402
from verl_loop_support import REAL_WORKER_OVERRIDES, compose_config, local_ray, print_timing, run_fit  # noqa: E402

pytestmark = [pytest.mark.verl_workers, pytest.mark.slow, pytest.mark.e2e]

#: the method each variant trains: GRPO, or a control method with GRPO's advantages zeroed or flipped
METHODS = {"advantages": "grpo", "zeroed": "grpo_zeroed", "flipped": "grpo_flipped"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The native learning test's model (same spec, same texts), questions and prompt, as verl data."""
    import json

    from spader_pipeline.data.formats import verl_rows
    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model
    from spader_pipeline.retrieval import build_index_from_file, running_service

    root = tmp_path_factory.mktemp("verl-learns")
    texts = [f"{r['title']}\n{r['contents']}" for r in corpus_records()] * 3 + [TEMPLATE] * 5
    spec = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=2048)
    model = build_base_model(texts, root / "model", spec=spec, vocab_size=400, min_frequency=1)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in corpus_records()))
    build_index_from_file(corpus, root / "bm25", "bm25")
    qa = pd.DataFrame([{**q, "split": "train", "data_source": "toy"} for q in QUESTIONS[:2]])
    data = root / "verl"
    data.mkdir()
    rows = verl_rows(qa, "train", TEMPLATE, "spader_search")
    rows.to_parquet(data / "train.parquet")
    rows.to_parquet(data / "validation.parquet")
    with running_service(root / "bm25") as url:
        yield {"root": root, "model": model, "data": data, "url": url}


@pytest.fixture(scope="module")
def cpu_ray(workspace):
    from fixed_answer_reward import WORKER_FLAG

    with local_ray(gpus=1, cpu_platform=True, modules=["fixed_answer_reward"], env={WORKER_FLAG: "1"}):
        yield


def mean_reward_per_step(workspace, run_dir: Path, method: str, seed: int) -> list[float]:
    from fixed_answer_reward import CONTROLS, REWARD_NAME

    from spader_pipeline.algorithms.methods import registered

    block = {"method": method, "reward": {"tool_round_cost": 0.0}, "options": {}}
    overrides = [
        *REAL_WORKER_OVERRIDES,
        f"reward.reward_manager.name={REWARD_NAME}",
        "data.max_response_length=16",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1",
        f"actor_rollout_ref.rollout.seed={seed}",
        "actor_rollout_ref.actor.optim.lr=2e-2",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.0",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        f"trainer.total_epochs={STEPS}",
    ]
    with contextlib.ExitStack() as stack:
        for control in CONTROLS:  # a control is a method of its own, as a user's would be (one key on verl)
            if control.name == method:
                stack.enter_context(registered(control))
        config = compose_config(block, workspace, run_dir, steps=STEPS, overrides=overrides,
                                validation={"every": 0, "before_train": False, "max_questions": None})
        metrics = run_fit(config, run_dir)
    return [m["data"]["critic/score/mean"] for m in metrics if "critic/score/mean" in m["data"]]


@pytest.mark.parametrize("variant", METHODS)
def test_the_mean_reward_rises_only_when_the_advantages_point_up(workspace, cpu_ray, tmp_path, variant):
    curves = {}
    for seed in SEEDS:
        start = time.perf_counter()
        curves[seed] = mean_reward_per_step(workspace, tmp_path / f"seed{seed}", METHODS[variant], seed)
        print_timing(f"{variant} seed {seed}: fit() of {STEPS} steps", time.perf_counter() - start)
        assert len(curves[seed]) == STEPS
    rises = {seed: reward_rise(curve) for seed, curve in curves.items()}
    mean_rise = sum(rises.values()) / len(rises)
    report = {seed: [round(r, 3) for r in curve] for seed, curve in curves.items()}
    print(f"{variant}: mean rise {mean_rise:.3f} {report}", file=sys.stderr)
    if variant == "advantages":
        assert mean_rise > MARGIN, (rises, report)
    else:
        assert mean_rise < NO_LEARNING_BOUND, (rises, report)
