"""Boundary states: captured in a real rollout, carried into the batch, and the update started from
them gives today's loss and gradients (issue 25's acceptance test)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from native_toy import QUESTIONS, TEMPLATE

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.modeling import load_model_and_tokenizer, train_top_layers
from spader_pipeline.modeling.shared_prefix import common_prefix_length
from spader_pipeline.native.batch import Advantages, build_batch, usable_capture
from spader_pipeline.native.update import (
    actor_config,
    length_sorted_micro_batches,
    response_logprobs,
    update_policy,
)
from spader_pipeline.retrieval.service import LocalSearch

FIRST = 2  # the 3-block model trains its top block; block 1's output is the boundary


def _rollout(model_dir, index_dir, **generator_kwargs):
    """Two questions × four sampled trajectories, three turns: rows end their turns at different steps
    (many end tokens), the cache is continued, its gaps closed, the shared prefix encoded once, and
    the observations prefilled in blocks of rows (a block per distinct length)."""
    from spader_pipeline.retrieval import load_retriever

    model, tokenizer = load_model_and_tokenizer(model_dir)
    gen = HFGenerator(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=10, seed=3),
                      max_prompt_tokens=1024, prefill_block_cost=(0, 0), **generator_kwargs)
    gen.eos_ids |= set(range(20, 60))  # ~10% of the vocabulary ends a turn: rows finish at different steps
    gen.gap_share = 0.01
    group = [{**q, "uid": f"g{k}"} for k, q in enumerate(QUESTIONS[:2]) for _ in range(4)]
    config = RolloutConfig(max_turns=3, max_response_tokens=400, topk=2, max_document_chars=60)
    trajectories = run_rollouts_sync(group, gen, LocalSearch(load_retriever(index_dir)), config, TEMPLATE)
    return model, tokenizer, gen, group, trajectories


@pytest.fixture(scope="module")
def rolled_out(native_deep_model_dir, toy_index_dir):
    return _rollout(native_deep_model_dir, toy_index_dir, capture_states_from_layer=FIRST - 1)


def test_captured_states_equal_a_plain_forward_at_the_boundary(rolled_out):
    model, _, gen, _, trajectories = rolled_out
    assert gen.kv_reuses >= 1 and gen.shared_prefills >= 1 and gen.gap_compactions >= 1 and gen.blocked_prefills >= 1
    assert max(t.num_turns for t in trajectories) >= 2
    turn_lengths = {step.token_span[1] - step.token_span[0] for t in trajectories for step in t.steps}
    assert len(turn_lengths) > 1  # rows ended their turns at different steps
    captured = gen.captured_states()
    assert len(captured) == len(trajectories)
    for trajectory, capture in zip(trajectories, captured, strict=True):
        tokens = list(trajectory.prompt_ids) + list(trajectory.response_ids)
        n = capture.token_ids.shape[0]
        assert usable_capture(trajectory, capture) and n == len(tokens) - 1  # all but the last sampled token
        with torch.no_grad():
            plain = model(input_ids=torch.tensor([tokens[:n]]), output_hidden_states=True).hidden_states[FIRST][0]
        assert torch.allclose(capture.states, plain, atol=1e-6), float((capture.states - plain).abs().max())


def all_logprobs(model, batch, config, bf16) -> torch.Tensor:
    """Log-probs ``[B, R]`` of the whole batch in one no-grad pass (the straightforward old log-probs)."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    with torch.no_grad():
        for rows in length_sorted_micro_batches(batch, config.micro_batch_size, config.micro_batch_max_tokens):
            out[rows] = response_logprobs(model, batch, rows, temperature=config.temperature, bf16=bf16,
                                          with_entropy=False)[0].cpu()
    return out


def _advantages(batch) -> Advantages:
    """Non-zero advantages on model tokens (a random model earns no reward to learn from)."""
    adv = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.response_mask
    zeros = torch.zeros(len(batch.uids))
    return Advantages(token_rewards=torch.zeros_like(adv), returns=zeros, advantages=adv, discovery=zeros,
                      cost_coefficient=0.0)


def _update(model, batch, config, reference, shares):
    """One update with a zero learning rate: the loss terms and every trainable gradient."""
    model = copy.deepcopy(model).train()
    trainable = train_top_layers(model, 1)
    optimizer = torch.optim.SGD(trainable, lr=0.0)
    stats = update_policy(model, reference, optimizer, trainable, batch, _advantages(batch), config,
                          actor_config(config), bf16=False, step=1, reference_shares_boundary=shares)
    return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("kl_coef", "ppo_epochs"), [(0.0, 1), (0.5, 2)])
def test_update_from_boundary_states_equals_the_full_recompute(rolled_out, tiny_config, kl_coef, ppo_epochs):
    """Same math: on one rolled-out batch, the loss terms and every trainable parameter's gradient
    with the rollout's boundary states equal the update that recomputes the frozen blocks (with a
    reference model and several epochs, the reference and old-log-prob passes too)."""
    model, tokenizer, gen, group, trajectories = rolled_out
    batch = build_batch(trajectories, group, tokenizer.pad_token_id, captured=gen.captured_states(),
                        boundary_block=FIRST)
    assert batch.boundary is not None and batch.boundary.shape[:2] == batch.input_ids.shape
    today = dataclasses.replace(batch, boundary=None, boundary_block=None)
    config = tiny_config(prompts_per_step=2, group_size=4, micro_batch_size=4, kl_coef=kl_coef,
                         ppo_epochs=ppo_epochs, max_grad_norm=1e6, trainable_layers=1)
    reference = None
    if kl_coef:  # a reference whose trained block differs (a KL term), frozen blocks shared
        reference = copy.deepcopy(model).eval().requires_grad_(False)
        with torch.no_grad():
            reference.model.layers[2].mlp.up_proj.weight.mul_(1.5)
    new_stats, new_grads = _update(model, batch, config, reference, shares=True)
    old_stats, old_grads = _update(model, today, config, reference, shares=False)
    assert new_grads.keys() == old_grads.keys() and all(k.startswith(("model.layers.2.", "model.norm.")) for k in new_grads)
    for name, grad in old_grads.items():
        error = float((new_grads[name] - grad).abs().max())
        assert error <= 1e-4 * float(grad.abs().max()) + 1e-7, (name, error)
    for key, value in old_stats.sums.items():
        assert new_stats.sums[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert new_stats.grad_norm == pytest.approx(old_stats.grad_norm, rel=1e-4)
    if kl_coef:
        assert old_stats.sums["kl"] != 0
    with torch.no_grad():
        assert torch.allclose(all_logprobs(model, batch, config, False), all_logprobs(model, today, config, False),
                              atol=1e-4)


def test_a_token_budget_per_micro_batch_leaves_loss_and_gradients_unchanged(rolled_out, tiny_config):
    """``micro_batch_max_tokens`` only regroups rows: same loss terms and gradients as one pass."""
    model, tokenizer, gen, group, trajectories = rolled_out
    batch = build_batch(trajectories, group, tokenizer.pad_token_id, captured=gen.captured_states(),
                        boundary_block=FIRST)
    whole = tiny_config(prompts_per_step=2, group_size=4, micro_batch_size=8, max_grad_norm=1e6, trainable_layers=1)
    budget = dataclasses.replace(whole, micro_batch_max_tokens=int(batch.attention_mask.sum(dim=1).max()))
    assert len(length_sorted_micro_batches(batch, 8, budget.micro_batch_max_tokens)) > 1
    split_stats, split_grads = _update(model, batch, budget, None, shares=True)
    whole_stats, whole_grads = _update(model, batch, whole, None, shares=True)
    for name, grad in whole_grads.items():
        assert float((split_grads[name] - grad).abs().max()) <= 1e-4 * float(grad.abs().max()) + 1e-7, name
    for key, value in whole_stats.sums.items():
        assert split_stats.sums[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("boundary", [True, False])
def test_the_update_without_the_shared_prefix_gives_the_same_loss_and_gradients(rolled_out, tiny_config, boundary):
    """``shared_prefix: false`` (a GPU's default: every pass one forward over whole rows) regroups only
    the arithmetic: the loss terms and every gradient of the update that encodes the instruction once,
    from the rollout's boundary states or running the frozen blocks, with a reference and two epochs."""
    model, tokenizer, gen, group, trajectories = rolled_out
    batch = build_batch(trajectories, group, tokenizer.pad_token_id, captured=gen.captured_states(),
                        boundary_block=FIRST)
    assert common_prefix_length(batch.input_ids, batch.attention_mask) > 0  # an instruction to share
    if not boundary:
        batch = dataclasses.replace(batch, boundary=None, boundary_block=None)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():
        reference.model.layers[2].mlp.up_proj.weight.mul_(1.5)
    runs = {}
    for shared in (True, False):
        config = tiny_config(prompts_per_step=2, group_size=4, micro_batch_size=4, kl_coef=0.5, ppo_epochs=2,
                             max_grad_norm=1e6, trainable_layers=1, shared_prefix=shared)
        runs[shared] = _update(model, batch, config, reference, shares=boundary)
    (once, once_grads), (every, every_grads) = runs[True], runs[False]
    assert once.shared_prefix and not every.shared_prefix
    assert once_grads.keys() == every_grads.keys() and once_grads
    for name, grad in once_grads.items():
        assert float((every_grads[name] - grad).abs().max()) <= 1e-4 * float(grad.abs().max()) + 1e-7, name
    for key, value in once.sums.items():
        assert every.sums[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _trained_copy(model, update) -> dict[str, torch.Tensor]:
    """The trainable parameters of a copy of ``model`` (top block) after ``update(copy, SGD, trainable)``."""
    copy_ = copy.deepcopy(model).train()
    trainable = train_top_layers(copy_, 1)
    update(copy_, torch.optim.SGD(trainable, lr=0.5), trainable)
    return {n: p.detach().clone() for n, p in copy_.named_parameters() if p.requires_grad}


def _plain_loss_backward(policy, batch, rows, old, adv, config, actor) -> None:
    """The straightforward loop's clipped loss on ``rows`` against ``old`` log-probs, backpropagated."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    logp, _ = response_logprobs(policy, batch, rows, temperature=config.temperature, bf16=False, with_entropy=False)
    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=old[rows], log_prob=logp, advantages=adv.advantages[rows],
        response_mask=batch.response_mask[rows], loss_agg_mode=config.loss_agg_mode, config=actor)
    loss.backward()


def _assert_moved_and_equal(model, expected: dict, got: dict) -> None:
    start = {n: p for n, p in model.named_parameters() if n in expected}
    assert any(not torch.equal(expected[n], start[n]) for n in expected)  # the updates moved the parameters
    for name, value in expected.items():
        assert torch.allclose(got[name], value, rtol=1e-4, atol=1e-6), name


def test_later_epochs_weigh_against_the_log_probs_before_the_first_update(rolled_out, tiny_config):
    """With several epochs the behaviour policy's log-probs are kept from the first epoch's pass: the
    parameters equal those of the straightforward loop that computes them in a pass of their own first."""
    model, tokenizer, gen, group, trajectories = rolled_out
    batch = build_batch(trajectories, group, tokenizer.pad_token_id, captured=gen.captured_states(),
                        boundary_block=FIRST)
    config = tiny_config(prompts_per_step=2, group_size=4, micro_batch_size=4, ppo_epochs=3, kl_coef=0.0,
                         max_grad_norm=1e6, trainable_layers=1)
    adv = _advantages(batch)

    def ours(policy, optimizer, trainable):
        update_policy(policy, None, optimizer, trainable, batch, adv, config, actor_config(config), bf16=False, step=1)

    def separate_pass_first(policy, optimizer, trainable):
        actor = actor_config(config)
        total = float(batch.response_mask.sum())
        actor.global_batch_info.update(dp_size=1, batch_num_tokens=total, global_batch_size=len(batch.uids))
        old = all_logprobs(policy, batch, config, False)
        for _ in range(config.ppo_epochs):
            optimizer.zero_grad(set_to_none=True)
            for rows in length_sorted_micro_batches(batch, config.micro_batch_size):
                _plain_loss_backward(policy, batch, rows, old, adv, config, actor)
            optimizer.step()

    _assert_moved_and_equal(model, _trained_copy(model, separate_pass_first), _trained_copy(model, ours))


def test_mini_batches_take_one_step_each_against_the_rollout_policy(rolled_out, tiny_config):
    """``ppo_mini_batches: 2`` on 2 groups: one optimiser step per group, each a token-mean over its own
    group, every one weighed against the log-probs before the first step: the parameters equal the
    straightforward loop's, and two steps were taken."""
    model, tokenizer, gen, group, trajectories = rolled_out
    batch = build_batch(trajectories, group, tokenizer.pad_token_id, captured=gen.captured_states(),
                        boundary_block=FIRST)
    config = tiny_config(prompts_per_step=2, group_size=4, micro_batch_size=4, ppo_mini_batches=2, kl_coef=0.0,
                         max_grad_norm=1e6, trainable_layers=1)
    assert actor_config(config).ppo_mini_batch_size == 1
    adv = _advantages(batch)
    groups = [torch.tensor([r for r, u in enumerate(batch.uids.tolist()) if u == uid])
              for uid in dict.fromkeys(batch.uids.tolist())]
    assert len(groups) == 2 and [len(g) for g in groups] == [4, 4]
    steps = []

    def ours(policy, optimizer, trainable):
        stats = update_policy(policy, None, optimizer, trainable, batch, adv, config, actor_config(config),
                              bf16=False, step=1)
        steps.append(stats.optimizer_steps)

    def one_group_at_a_time(policy, optimizer, trainable):
        actor = actor_config(config)
        old = all_logprobs(policy, batch, config, False)
        for rows in groups:
            actor.global_batch_info.update(dp_size=1, batch_num_tokens=float(batch.response_mask[rows].sum()),
                                           global_batch_size=len(rows))
            optimizer.zero_grad(set_to_none=True)
            _plain_loss_backward(policy, batch, rows, old, adv, config, actor)
            optimizer.step()

    _assert_moved_and_equal(model, _trained_copy(model, one_group_at_a_time), _trained_copy(model, ours))
    assert steps == [2]


def test_mini_batches_must_split_the_groups_evenly(tiny_config):
    with pytest.raises(ValueError, match="ppo_mini_batches=3 must be >= 1 and divide prompts_per_step=4"):
        tiny_config(prompts_per_step=4, group_size=2, micro_batch_size=2, ppo_mini_batches=3)


def test_unusable_captures_fall_back_to_the_full_recompute(rolled_out, caplog):
    _, tokenizer, gen, group, trajectories = rolled_out
    captured = gen.captured_states()
    bad_ids = dataclasses.replace(captured[0], token_ids=captured[0].token_ids.flip(0))
    short = dataclasses.replace(captured[1], token_ids=captured[1].token_ids[:5], states=captured[1].states[:5])
    cases = {
        "another trajectory's states": captured[::-1],
        "other token ids": [bad_ids, *captured[1:]],
        "too short to cover the model tokens": [captured[0], short, *captured[2:]],
        "one missing": [None, *captured[1:]],
        "none at all (generate path)": [],
    }
    for name, captures in cases.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="spader_pipeline.native.batch"):
            batch = build_batch(trajectories, group, tokenizer.pad_token_id, captured=captures, boundary_block=FIRST)
        assert batch.boundary is None and batch.boundary_block is None, name
        assert "frozen blocks recomputed" in caplog.text, name
    assert usable_capture(trajectories[0], captured[0])


def test_capture_is_opt_in_and_off_with_generate(native_deep_model_dir, toy_index_dir, caplog):
    _, _, plain, _, _ = _rollout(native_deep_model_dir, toy_index_dir)
    assert plain.capture is None and plain.captured_states() == []
    with caplog.at_level(logging.WARNING, logger="spader_pipeline.agent.decode_engine"):
        _, _, generate, _, _ = _rollout(native_deep_model_dir, toy_index_dir, drop_finished_rows=False,
                                        capture_states_from_layer=FIRST - 1)
    assert generate.capture is None and generate.captured_states() == [] and "no state capture" in caplog.text


def test_seeded_runs_with_and_without_reuse_give_the_same_history(tmp_path, native_deep_model_dir, toy_index_dir,
                                                                  tiny_config, monkeypatch):
    from spader_pipeline.native import train_native, trainer
    from spader_pipeline.retrieval import load_retriever

    compute_advantages = trainer.compute_advantages

    def with_signal(batch, method, **kwargs):  # a random model earns no reward: add a seeded signal
        adv = compute_advantages(batch, method, **kwargs)
        signal = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(kwargs["global_step"]))
        return dataclasses.replace(adv, advantages=adv.advantages + signal * batch.response_mask)

    monkeypatch.setattr(trainer, "compute_advantages", with_signal)

    # In fp32 on every machine (bf16=False, not auto): the claim is "same math", and the two paths agree
    # only there. Under bf16 autocast the captured states come from the rollout's cached decoding and
    # the recompute from one prefill; each rounds its products to bf16 (~3 significant digits) after
    # summing in another order, and the CPU's kernels (AVX-512 bf16, AMX) set that order. loss/kl, a
    # small mean of differences of nearly equal log-probs, then differs far beyond fp32's reassociation.
    histories = {}
    for reuse in (True, False):
        config = tiny_config(method="grpo", options={}, total_steps=2, trainable_layers=1, kl_coef=0.1,
                             learning_rate=1e-3, reuse_rollout_states=reuse, log_samples_every=0, bf16=False)
        result = train_native(config, model_path=native_deep_model_dir, samples=QUESTIONS,
                              search=LocalSearch(load_retriever(toy_index_dir)), run_dir=tmp_path / str(reuse),
                              prompt_template=TEMPLATE)
        histories[reuse] = result.history
    reused, recomputed = histories[True], histories[False]
    assert [h["perf/reused_rollout_states"] for h in reused] == [1.0, 1.0]
    assert [h["perf/reused_rollout_states"] for h in recomputed] == [0.0, 0.0]
    # Step 1: the same model on the same batch (float reassociation only). Step 2 starts from AdamW's
    # first update, ~lr × sign(gradient), which turns float noise in near-zero gradient entries into
    # a few opposite steps of size lr: close, not equal.
    for new, old, rel in zip(reused, recomputed, (1e-4, 2e-2), strict=True):
        for key in ("method_reward/mean", "answer/f1", "rollout/response_tokens", "retrieval/recall"):
            assert new[key] == old[key], key
        assert new["optim/grad_norm"] > 1e-3
        for key in ("loss/policy", "loss/kl", "loss/total", "optim/grad_norm", "policy/entropy"):
            assert new[key] == pytest.approx(old[key], rel=rel, abs=1e-7), key


def test_a_rollout_kv_budget_decodes_whole_groups_per_pass_and_keeps_the_boundary_states(
        tmp_path, native_deep_model_dir, toy_index_dir, tiny_config, monkeypatch):
    from transformers import AutoConfig

    from spader_pipeline.modeling.memory_budget import GROWTH, kv_bytes_per_token
    from spader_pipeline.native import train_native, trainer
    from spader_pipeline.retrieval import load_retriever

    passes: list[int] = []
    rollouts = trainer.run_rollouts_sync

    def counted(group, *args, **kwargs):
        passes.append(len(group))
        return rollouts(group, *args, **kwargs)

    monkeypatch.setattr(trainer, "run_rollouts_sync", counted)
    model_config = AutoConfig.from_pretrained(native_deep_model_dir)
    config = tiny_config(method="grpo", options={}, total_steps=1, trainable_layers=1, log_samples_every=0)
    row_mb = kv_bytes_per_token(model_config) * (config.max_prompt_tokens + config.rollout.max_response_tokens) \
        * GROWTH / 2**20
    budgeted = dataclasses.replace(config, rollout_kv_cache_budget_mb=3.5 * row_mb)  # 3 rows fit: one group of 2
    assert config.rollout_rows(model_config) == 4 and budgeted.rollout_rows(model_config) == 2
    assert dataclasses.replace(config, rollout_kv_cache_budget_mb=0.5 * row_mb).rollout_rows(model_config) == 1

    result = train_native(budgeted, model_path=native_deep_model_dir, samples=QUESTIONS,
                          search=LocalSearch(load_retriever(toy_index_dir)), run_dir=tmp_path, prompt_template=TEMPLATE)
    assert passes == [2, 2]  # two passes of one whole group each, every trajectory rolled out once
    step = result.history[-1]
    assert step["perf/reused_rollout_states"] == 1.0  # the captures of both passes reach the update
    with pytest.raises(ValueError, match="rollout_kv_cache_budget_mb"):
        dataclasses.replace(config, rollout_kv_cache_budget_mb=0)
