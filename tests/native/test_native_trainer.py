from __future__ import annotations

import numpy as np
import pytest
import torch
from native_toy import QUESTIONS, TEMPLATE
from transformers import AutoModelForCausalLM

from spader_pipeline.agent.rollout import LocalSearch, Step, Trajectory
from spader_pipeline.native import NativeTrainerConfig, train_native
from spader_pipeline.native.batch import build_batch, compute_advantages
from spader_pipeline.native.checkpoint import latest_checkpoint, load_trainer_state
from spader_pipeline.native.trainer import _questions_for_step, response_logprobs


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_size": 1}, "at least 2"),
        ({"micro_batch_size": 3}, "must divide"),
        ({"method": "ppo"}, "not one of"),
        ({"method": "grpo", "reward": {"enable_exploration": True}}, "enable_exploration"),
        ({"clip_ratio_c": 1.0}, "dual-clip"),
        ({"temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 600, "max_response_tokens": 500}, "max_response_tokens"),
    ],
)
def test_config_rejects_inconsistent_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        NativeTrainerConfig(**{"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 4, **overrides})


def test_config_from_mapping_names_unknown_keys():
    with pytest.raises(ValueError, match="lr"):
        NativeTrainerConfig.from_mapping({"lr": 1.0})


def test_questions_per_step_are_a_pure_function_of_the_step_and_cover_each_epoch():
    samples = [{"id": str(i)} for i in range(10)]
    first = [q["id"] for s in range(1, 6) for q in _questions_for_step(samples, s, 2, seed=3)]
    assert sorted(first) == [str(i) for i in range(10)]
    assert _questions_for_step(samples, 4, 2, seed=3) == _questions_for_step(samples, 4, 2, seed=3)


def _trajectory(prompt, turns, predicted, retrieved):
    """A token-level trajectory: each turn is (model_tokens, observation_tokens)."""
    response, mask, steps = [], [], []
    for k, (model_tokens, obs_tokens) in enumerate(turns):
        start = len(response)
        response += model_tokens
        mask += [1] * len(model_tokens)
        steps.append(Step(turn=k + 1, text="t", kind="search" if obs_tokens else "answer", queries=("q",) if obs_tokens else (),
                          doc_ids=[["d"]] if obs_tokens else [], retrieved_texts=[retrieved[k]] if obs_tokens else [],
                          token_span=(start, len(response))))
        response += obs_tokens
        mask += [0] * len(obs_tokens)
    return Trajectory(id="x", question="q", messages=[], steps=steps, finish_reason="answer", predicted=predicted,
                      prompt_ids=prompt, response_ids=response, response_mask=mask)


def _toy_batch():
    gt = [["Ghana"], ["Mali"]]
    trajs = [
        _trajectory([1, 2, 3], [([5, 6], [7, 8, 9]), ([10, 11], [])], ("Ghana",), ["Ghana is a country"]),
        _trajectory([1, 2, 3], [([5, 6], [7, 8, 9]), ([10, 11], [])], ("Mali",), ["nothing here"]),
        _trajectory([1, 2], [([5], [])], None, []),
        _trajectory([1, 2], [([5, 6, 7], [8]), ([9], [])], ("Ghana", "Mali"), ["Mali and Ghana"]),
    ]
    samples = [{"uid": "a", "ground_truth": gt}] * 2 + [{"uid": "b", "ground_truth": gt}] * 2
    return build_batch(trajs, samples, pad_id=0)


def test_build_batch_lays_out_tokens_scores_answers_and_finds_entities_in_retrieved_text_only():
    batch = _toy_batch()
    assert batch.input_ids.shape == (4, 3 + 7) and batch.response_mask.shape == (4, 7)
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert batch.prompt_lengths.tolist() == [3, 3, 2, 2]
    assert batch.f1.tolist() == pytest.approx([2 / 3, 2 / 3, 0.0, 1.0])
    assert batch.format_ok.tolist() == [True, True, False, True]
    assert batch.found[:, 0].sum(dim=-1).tolist() == [1, 0, 0, 2]
    assert batch.query_counts[:, 0].tolist() == [1, 1, 0, 1]


def test_grpo_uses_verl_estimator_and_spader_pays_for_discoveries():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    batch = _toy_batch()
    grpo = compute_advantages(batch, "grpo", global_step=1, reward={}, advantage={})
    expected, _ = compute_grpo_outcome_advantage(grpo.token_rewards, batch.response_mask, batch.uids)
    assert torch.allclose(grpo.advantages, expected)
    assert grpo.discovery.tolist() == [0.0] * 4

    spader = compute_advantages(batch, "spader", global_step=1, reward={"cost_free_steps": 0}, advantage={"gamma": 0.9})
    assert spader.discovery[0] > 0 and spader.discovery[1] == 0  # same answer F1, only traj 0 retrieved gold
    assert spader.advantages[0, 0] > spader.advantages[1, 0]
    assert (spader.advantages * (1 - batch.response_mask)).abs().sum() == 0
    for method, adv in {"calibadv": {}, "tspo": {}}.items():
        out = compute_advantages(batch, method, global_step=1, reward={}, advantage=adv)
        assert out.advantages.shape == batch.response_mask.shape and torch.isfinite(out.advantages).all()


def test_tool_cost_follows_the_real_global_step():
    batch = _toy_batch()
    reward = {"tool_round_cost": 0.5, "cost_free_steps": 10, "cost_rampup_steps": 10}
    before = compute_advantages(batch, "spader", global_step=5, reward=reward, advantage={})
    during = compute_advantages(batch, "spader", global_step=15, reward=reward, advantage={})
    assert before.cost_coefficient == 0.0 and during.cost_coefficient == pytest.approx(0.25)
    assert during.token_rewards.sum() < before.token_rewards.sum()


def test_response_logprobs_match_full_forward(native_model_dir):
    model = AutoModelForCausalLM.from_pretrained(native_model_dir)
    batch = _toy_batch()
    logp, entropy = response_logprobs(model, batch, slice(0, 4), temperature=0.7, bf16=False, with_entropy=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 0.7
    full = torch.log_softmax(logits, dim=-1)
    for i in range(4):
        p = int(batch.prompt_lengths[i])
        for j in np.flatnonzero(batch.response_mask[i].numpy()):
            expected = full[i, p + j - 1, batch.response_ids[i, j]]
            assert torch.isclose(logp[i, j], expected, atol=1e-4)
    assert (logp * (1 - batch.response_mask)).abs().sum() == 0 and (entropy >= 0).all()


@pytest.mark.parametrize("method", ["grpo", "spader"])
def test_two_native_steps_log_metrics_samples_and_checkpoints(tmp_path, native_model_dir, toy_index_dir, tiny_config, method):
    from spader_pipeline.retrieval import load_retriever

    logged, artifacts = [], []
    reward = {"enable_exploration": method == "spader", "cost_free_steps": 0}
    result = train_native(
        tiny_config(method=method, reward=reward), model_path=native_model_dir, samples=QUESTIONS,
        search=LocalSearch(load_retriever(toy_index_dir)), run_dir=tmp_path, prompt_template=TEMPLATE,
        log_metrics=lambda m, s: logged.append((s, dict(m))), log_artifact=artifacts.append,
    )
    assert result.steps == 2 and [s for s, _ in logged] == [1, 2]
    assert {"reward/mean", "answer/f1", "retrieval/recall", "adv/std", "loss/kl", "policy/entropy",
            "perf/generate_tokens_per_second"} <= set(logged[0][1])
    assert [p.name for p in artifacts] == ["step_000001.json", "step_000002.json"]
    step, path = latest_checkpoint(tmp_path)
    assert step == 2 and load_trainer_state(path)["extra"]["method"] == method
    AutoModelForCausalLM.from_pretrained(result.final_model_dir)
