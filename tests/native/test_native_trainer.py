from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from native_toy import QUESTIONS, TEMPLATE, toy_batch
from transformers import AutoModelForCausalLM

from spader_pipeline.algorithms import score_answers
from spader_pipeline.native import NativeTrainerConfig, train_native
from spader_pipeline.native.batch import questions_for_step
from spader_pipeline.native.checkpoint import latest_checkpoint, load_trainer_state
from spader_pipeline.native.update import length_sorted_micro_batches, response_logprobs
from spader_pipeline.retrieval.service import LocalSearch


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_size": 1}, "at least 2"),
        ({"micro_batch_size": 3}, "must divide"),
        ({"method": "ppo"}, "unknown method"),
        ({"method": "grpo", "reward": {"enable_exploration": True}}, "enable_exploration"),
        ({"clip_ratio_c": 1.0}, "dual-clip"),
        ({"temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 600, "rollout": {"max_response_tokens": 500}}, "max_response_tokens"),
        ({"method": "tspo", "options": {"gamma": 0.9}}, "unknown tspo options"),
        ({"reward": {"lambda_val": 1.0}}, "unknown reward settings"),
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
    first = [q["id"] for s in range(1, 6) for q in questions_for_step(samples, s, 2, seed=3)]
    assert sorted(first) == [str(i) for i in range(10)]
    assert questions_for_step(samples, 4, 2, seed=3) == questions_for_step(samples, 4, 2, seed=3)


def test_response_logprobs_match_full_forward(native_model_dir):
    model = AutoModelForCausalLM.from_pretrained(native_model_dir)
    batch = toy_batch()
    logp, entropy = response_logprobs(model, batch, slice(0, 4), temperature=0.7, bf16=False, with_entropy=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 0.7
    full = torch.log_softmax(logits, dim=-1)
    for i in range(4):
        p = int(batch.prompt_lengths[i])
        for j in np.flatnonzero(batch.response_mask[i].numpy()):
            expected = full[i, p + j - 1, batch.response_ids[i, j]]
            assert torch.isclose(logp[i, j], expected, atol=1e-4)
    assert (logp * (1 - batch.response_mask)).abs().sum() == 0 and (entropy >= 0).all()


def test_length_sorted_micro_batches_cover_every_row_once_and_give_the_same_logprobs(native_model_dir):
    model = AutoModelForCausalLM.from_pretrained(native_model_dir)
    batch = toy_batch()
    parts = length_sorted_micro_batches(batch, 2)
    lengths = batch.attention_mask.sum(dim=1)
    order = torch.cat(parts)
    assert sorted(order.tolist()) == list(range(len(lengths))) and (lengths[order].diff() >= 0).all()
    whole, _ = response_logprobs(model, batch, slice(0, 4), temperature=1.0, bf16=False, with_entropy=False)
    for rows in parts:
        part, _ = response_logprobs(model, batch, rows, temperature=1.0, bf16=False, with_entropy=False)
        assert torch.allclose(part, whole[rows], atol=1e-5)


@pytest.mark.parametrize(("max_tokens", "sizes"), [(None, [2, 2, 2]), (1_000, [2, 2, 2]), (45, [2, 1, 1, 1, 1]),
                                                 (1, [1] * 6)])
def test_a_token_budget_keeps_long_rows_in_small_micro_batches(max_tokens, sizes):
    lengths = torch.tensor([30, 10, 22, 25, 12, 40])
    batch = SimpleNamespace(attention_mask=(torch.arange(40)[None] < lengths[:, None]).long())
    parts = length_sorted_micro_batches(batch, 2, max_tokens)
    assert [len(p) for p in parts] == sizes
    order = torch.cat(parts)
    assert sorted(order.tolist()) == list(range(6)) and (lengths[order].diff() >= 0).all()
    # rows x longest row within the budget, but for a row alone
    assert all(len(p) == 1 or max_tokens is None or len(p) * int(lengths[p].max()) <= max_tokens for p in parts)


@pytest.mark.parametrize("method", ["grpo", "spader"])
def test_two_native_steps_log_metrics_samples_and_checkpoints(tmp_path, native_model_dir, toy_index_dir, tiny_config, method):
    from spader_pipeline.retrieval import load_retriever

    logged, artifacts = [], []
    result = train_native(
        tiny_config(method=method, reward={"cost_free_steps": 0}, options={}), model_path=native_model_dir, samples=QUESTIONS,
        search=LocalSearch(load_retriever(toy_index_dir)), run_dir=tmp_path, prompt_template=TEMPLATE,
        log_metrics=lambda m, s: logged.append((s, dict(m))), log_artifact=artifacts.append,
    )
    assert result.steps == 2 and [s for s, _ in logged] == [1, 2]
    assert {"method_reward/mean", "answer/f1", "retrieval/recall", "adv/std", "loss/kl", "policy/entropy",
            "perf/generate_tokens_per_second", "adv/corr_vs_grpo", "adv/rel_l2_vs_grpo", "adv/zero_frac", "adv/grpo_zero_frac", "group/distinct_query_seqs",
            "group/distinct_docs", "group/entity_recall_union", "group/first_divergence_turn",
            "rollout/search_failed"} <= set(logged[0][1])
    perf = logged[0][1]
    assert 0 < perf["perf/rollout_model_seconds"] <= perf["perf/rollout_seconds"]
    assert perf["perf/rollout_decode_steps"] >= 1
    # of the model's seconds, the turns' prefill forwards and their decoding steps; the prefill's padded share
    assert 0 < perf["perf/rollout_prefill_seconds"] + perf["perf/rollout_decoding_seconds"] <= perf["perf/rollout_model_seconds"]
    assert min(perf["perf/rollout_prefill_seconds"], perf["perf/rollout_decoding_seconds"]) > 0
    assert 0 <= perf["perf/rollout_prefill_padding"] < 1
    assert [p.name for p in artifacts] == ["step_000001.json", "step_000002.json"]
    step, path = latest_checkpoint(tmp_path)
    assert step == 2 and load_trainer_state(path)["extra"]["method"] == method
    AutoModelForCausalLM.from_pretrained(result.final_model_dir)


class DownSearch:
    """A retrieval service that is down: every search raises."""

    async def search(self, queries, topk=5, max_chars=None):
        raise ConnectionError("retrieval service down")


def test_a_step_counts_its_failed_searches(toy_index_dir):
    """A rollout never stops for a failed search (the model sees an error observation), so the step's
    metrics say how many searches failed: rewards earned against a broken tool are visible."""
    from spader_pipeline.agent.rollout import run_rollouts_sync
    from spader_pipeline.agent.scripted import ScriptedPolicy
    from spader_pipeline.agent.types import RolloutConfig
    from spader_pipeline.native.metrics import search_failures
    from spader_pipeline.retrieval import load_retriever

    served = run_rollouts_sync(QUESTIONS, ScriptedPolicy(), LocalSearch(load_retriever(toy_index_dir)), RolloutConfig(),
                               TEMPLATE)
    down = run_rollouts_sync(QUESTIONS, ScriptedPolicy(), DownSearch(), RolloutConfig(), TEMPLATE)
    assert all(any(s.kind == "search" for s in t.steps) for t in served + down)
    assert search_failures(served) == {"rollout/search_failed": 0.0}
    assert search_failures(down) == {"rollout/search_failed": 1.0}


def _one_step(tmp_path, model_dir, index_dir, config):
    from spader_pipeline.retrieval import load_retriever

    return train_native(config, model_path=model_dir, samples=QUESTIONS, search=LocalSearch(load_retriever(index_dir)),
                        run_dir=tmp_path, prompt_template=TEMPLATE)


def test_prompts_are_cut_at_max_prompt_tokens_not_at_the_response_budget(tmp_path, native_model_dir, toy_index_dir,
                                                                          tiny_config, caplog):
    # issue 11: the trainer passed rollout.max_response_tokens as the prompt limit, so a response
    # budget shorter than the prompt cut the prompt's head (the instructions) off.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(native_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": TEMPLATE.format(question=QUESTIONS[0]["question"])}],
                                     add_generation_prompt=True, tokenize=False)
    budget = len(tok.encode(prompt, add_special_tokens=False)) - 5
    assert budget > 10
    rollout = {"max_turns": 1, "max_response_tokens": budget}
    with caplog.at_level("WARNING", logger="spader_pipeline.agent.tokens"):
        _one_step(tmp_path / "a", native_model_dir, toy_index_dir, tiny_config(total_steps=1, rollout=rollout))
    assert "left-truncating" not in caplog.text
    with caplog.at_level("WARNING", logger="spader_pipeline.agent.tokens"):
        _one_step(tmp_path / "b", native_model_dir, toy_index_dir,
                  tiny_config(total_steps=1, rollout=rollout, max_prompt_tokens=budget))
    assert f"exceeds {budget}; left-truncating" in caplog.text


def test_trainable_layers_update_only_the_top_blocks(tmp_path, native_model_dir, toy_index_dir, tiny_config):
    start = AutoModelForCausalLM.from_pretrained(native_model_dir).state_dict()
    result = _one_step(tmp_path, native_model_dir, toy_index_dir,
                       tiny_config(total_steps=1, trainable_layers=1, learning_rate=1e-2, kl_coef=0.0))
    end = AutoModelForCausalLM.from_pretrained(result.final_model_dir).state_dict()
    changed = {k for k in start if not torch.equal(start[k], end[k])}
    assert changed and all(k.startswith(("model.layers.1.", "model.norm.")) for k in changed), changed


def test_validation_runs_before_training_and_on_its_schedule_with_the_shared_names(tmp_path, native_model_dir,
                                                                                   toy_index_dir, tiny_config):
    """Step 0 scores the starting policy, then every ``every`` steps and the last one; the subset is fixed."""
    from spader_pipeline.algorithms.validation import ValidationSettings
    from spader_pipeline.retrieval import load_retriever

    logged = []
    validation = [{**q, "id": f"v{i}", "data_source": "embedded"} for i, q in enumerate(QUESTIONS)]
    result = train_native(
        tiny_config(method="grpo", total_steps=3, options={}), model_path=native_model_dir, samples=QUESTIONS,
        search=LocalSearch(load_retriever(toy_index_dir)), run_dir=tmp_path, prompt_template=TEMPLATE,
        log_metrics=lambda m, s: logged.append((s, dict(m))), validation=validation,
        validation_settings=ValidationSettings(every=2, before_train=True, max_questions=2),
    )
    validated = [s for s, m in logged if "val/embedded/recall" in m]
    assert validated == [0, 2, 3]  # before training, every 2nd step, the last step
    assert [s for s, _ in logged] == [0, 1, 2, 3]
    assert set(logged[0][1]) == {"val/embedded/recall", "val/embedded/f1", "val/embedded/searches",
                                 "perf/validation_seconds"}
    assert result.history[0]["step"] == 0 and [h["step"] for h in result.history] == [0, 1, 2, 3]
    for _, m in logged:
        if "val/embedded/recall" in m:
            assert 0.0 <= m["val/embedded/recall"] <= 1.0 and m["val/embedded/searches"] >= 0.0


def test_validation_metrics_are_means_per_data_source():
    from spader_pipeline.algorithms.validation import ValidationSettings, validation_metrics

    out = validation_metrics(["a", "b", "a"], [1.0, 0.5, 0.0], [0.5, 0.5, 0.0], [2, 4, 0])
    assert out == {"val/a/recall": 0.5, "val/a/f1": 0.25, "val/a/searches": 1.0,
                   "val/b/recall": 0.5, "val/b/f1": 0.5, "val/b/searches": 4.0}
    settings = ValidationSettings(every=3, before_train=False)
    assert [s for s in range(0, 8) if settings.due(s, total_steps=7)] == [3, 6, 7]
    with pytest.raises(ValueError, match="max_questions"):
        ValidationSettings(max_questions=0)


def test_validation_batches_follow_batch_size():
    """None: one batch; an int: batches of that many in order; {source: n}: that source's questions in
    batches of their own, every other question in one batch. Each question exactly once."""
    from spader_pipeline.algorithms.validation import ValidationSettings, validation_batches

    sources = ["fitted", "embedded", "fitted", "embedded", "other"]
    assert validation_batches(sources, None) == [[0, 1, 2, 3, 4]]
    assert validation_batches(sources, 2) == [[0, 1], [2, 3], [4]]
    assert validation_batches(sources, {"fitted": 1}) == [[0], [2], [1, 3, 4]]
    assert validation_batches(sources, {"embedded": 2, "fitted": 1}) == [[0], [2], [1, 3], [4]]
    assert validation_batches(sources, {"absent": 1}) == [[0, 1, 2, 3, 4]]
    assert validation_batches([], 1) == validation_batches([], None) == validation_batches([], {"fitted": 1}) == []
    for bad in (0, True, {"fitted": 0}, {"fitted": 1.5}):
        with pytest.raises(ValueError, match="batch_size"):
            ValidationSettings(batch_size=bad)


def test_a_question_validated_alone_decodes_as_it_does_without_the_others(native_model_dir, toy_index_dir,
                                                                          tiny_config):
    """With ``batch_size: {fitted: 1}`` each fitted question is its own rollout, whatever is validated
    beside it, and every trajectory comes back in its question's place."""
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.native.validation import greedy_trajectories
    from spader_pipeline.retrieval import load_retriever

    config = tiny_config(method="grpo", total_steps=1, options={}, bf16=False)
    model, tokenizer = load_model_and_tokenizer(native_model_dir)
    search = LocalSearch(load_retriever(toy_index_dir))
    samples = [{**q, "id": f"v{i}", "data_source": "fitted" if i % 2 else "embedded"} for i, q in enumerate(QUESTIONS)]

    def texts(rows, batch_size=None):
        trajectories = greedy_trajectories(model.eval(), tokenizer, rows, search, config.rollout, TEMPLATE,
                                           max_new_tokens=config.max_new_tokens,
                                           max_prompt_tokens=config.max_prompt_tokens, batch_size=batch_size)
        return [[step.text for step in t.steps] for t in trajectories]

    mixed = texts(samples, {"fitted": 1})
    fitted = [i for i, s in enumerate(samples) if s["data_source"] == "fitted"]
    embedded = [i for i in range(len(samples)) if i not in fitted]
    assert fitted and embedded
    for i in fitted:
        assert mixed[i] == texts([samples[i]])[0]
    assert [mixed[i] for i in embedded] == texts([samples[i] for i in embedded])


def test_sampled_validation_settings_are_checked_and_read_per_source():
    from spader_pipeline.algorithms.validation import ValidationSettings

    settings = ValidationSettings(trajectories={"fitted": 5}, temperature=0.7)
    assert (settings.trajectories_of("fitted"), settings.trajectories_of("embedded"), settings.sampled) == (5, 1, True)
    assert not ValidationSettings().sampled and ValidationSettings(trajectories=3).trajectories_of("any") == 3
    for bad in (0, True, {"fitted": 0}, 1.5):
        with pytest.raises(ValueError, match="trajectories"):
            ValidationSettings(trajectories=bad)
    with pytest.raises(ValueError, match="temperature"):
        ValidationSettings(trajectories=2, temperature=0.0)


def test_a_sampled_question_is_scored_on_its_seeded_trajectories(native_model_dir, toy_index_dir, tiny_config):
    """``trajectories: {fitted: n}``: each fitted question's score is the mean over ``n`` trajectories sampled
    together from a generator its position and the validation seed fix (the same numbers again, whatever
    the torch seed), and the other questions are decoded greedy as before."""
    from spader_pipeline.algorithms.validation import ValidationSettings
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.native.validation import sampled_trajectories, validate_policy
    from spader_pipeline.retrieval import load_retriever

    config = tiny_config(method="grpo", total_steps=1, options={}, bf16=False)
    model, tokenizer = load_model_and_tokenizer(native_model_dir)
    search = LocalSearch(load_retriever(toy_index_dir))
    samples = [{**q, "id": f"v{i}", "data_source": "fitted" if i < 2 else "embedded"} for i, q in enumerate(QUESTIONS)]
    limits = {"max_new_tokens": config.max_new_tokens, "max_prompt_tokens": config.max_prompt_tokens}

    def scores(validation, torch_seed):
        torch.manual_seed(torch_seed)
        return validate_policy(model.eval(), tokenizer, samples, search, config.rollout, TEMPLATE, validation=validation,
                               temperature=1.0, **limits)

    sampled = ValidationSettings(trajectories={"fitted": 3}, temperature=1.0, seed=7)
    first = scores(sampled, 0)
    assert first == scores(sampled, 1)
    greedy = scores(ValidationSettings(), 0)
    assert {k: v for k, v in first.items() if "/embedded/" in k} == {k: v for k, v in greedy.items() if "/embedded/" in k}
    rows = sampled_trajectories(model.eval(), tokenizer, samples[1], 3, search, config.rollout, TEMPLATE,
                                temperature=1.0, seed=8, **limits)  # the second question: seed 7 + its position
    recalls = [score_answers(list(t.predicted or ()), samples[1]["ground_truth"]).recall for t in rows]
    first_question = sampled_trajectories(model.eval(), tokenizer, samples[0], 3, search, config.rollout, TEMPLATE,
                                          temperature=1.0, seed=7, **limits)
    recalls0 = [score_answers(list(t.predicted or ()), samples[0]["ground_truth"]).recall for t in first_question]
    assert first["val/fitted/recall"] == pytest.approx((np.mean(recalls0) + np.mean(recalls)) / 2)
    assert len({tuple(step.text for step in t.steps) for t in rows}) > 1  # sampled: not one trajectory thrice


def test_a_shared_step_0_validation_is_used_only_when_it_scored_the_same_start(tmp_path, native_model_dir,
                                                                               toy_index_dir, tiny_config):
    """Both methods start from one warm start: its validation is computed once (validate_warm_start)
    and reused as step 0 when model, questions and limits match; otherwise the trainer scores it."""
    from spader_pipeline.algorithms.validation import ValidationSettings
    from spader_pipeline.native.validation import validation_identity
    from spader_pipeline.retrieval import load_retriever

    config = tiny_config(method="grpo", total_steps=1, options={}, bf16=False)  # no timing probe: a fixed identity
    validation = [{**q, "id": f"v{i}", "data_source": "embedded"} for i, q in enumerate(QUESTIONS)]
    settings = ValidationSettings(every=0, before_train=True, max_questions=2)
    identity = validation_identity(native_model_dir, validation[:2], config.rollout, TEMPLATE,
                                   max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                                   bf16=False)
    planted = {"val/embedded/recall": 0.123, "val/embedded/f1": 0.1, "val/embedded/searches": 1.0}

    def step0(run_dir, shared):
        logged = []
        train_native(config, model_path=native_model_dir, samples=QUESTIONS,
                     search=LocalSearch(load_retriever(toy_index_dir)), run_dir=run_dir, prompt_template=TEMPLATE,
                     log_metrics=lambda m, s: logged.append((s, dict(m))), validation=validation,
                     validation_settings=settings, start_validation=shared)
        return logged[0][1]

    assert step0(tmp_path / "shared", {"identity": identity, "metrics": planted}) == planted
    alone = validation_identity(native_model_dir, validation[:2], config.rollout, TEMPLATE,
                                max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                                bf16=False, validation=ValidationSettings(batch_size={"embedded": 1}))
    assert alone != identity and alone["batch_size"] == {"embedded": 1}  # another batching: scored again
    assert "batch_size" not in identity  # one batch: as stored before the setting existed
    sampled = validation_identity(native_model_dir, validation[:2], config.rollout, TEMPLATE,
                                  max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens,
                                  bf16=False, validation=ValidationSettings(trajectories={"embedded": 4}),
                                  temperature=0.7)
    assert {k: sampled[k] for k in ("trajectories", "seed", "temperature")} == {
        "trajectories": {"embedded": 4}, "seed": 0, "temperature": 0.7}  # sampled: scored again
    assert "trajectories" not in identity  # greedy: as stored before the setting existed
    other = {"identity": {**identity, "questions": ["v0"]}, "metrics": planted}
    assert step0(tmp_path / "other", other)["val/embedded/recall"] != 0.123  # scored by the trainer itself


def test_a_time_budget_stops_before_a_step_that_would_pass_it_and_validates_the_last(tmp_path, native_model_dir,
                                                                                      toy_index_dir, tiny_config):
    """``max_seconds``: the first step always runs; a budget shorter than a step ends the run after it,
    saved and validated as a last step is, although the schedule (every 5) would not validate step 1."""
    from spader_pipeline.algorithms.validation import ValidationSettings
    from spader_pipeline.retrieval import load_retriever

    logged = []
    validation = [{**q, "id": f"v{i}", "data_source": "embedded"} for i, q in enumerate(QUESTIONS)]
    result = train_native(
        tiny_config(method="grpo", total_steps=10, max_seconds=1e-3, options={}), model_path=native_model_dir,
        samples=QUESTIONS, search=LocalSearch(load_retriever(toy_index_dir)), run_dir=tmp_path,
        prompt_template=TEMPLATE, log_metrics=lambda m, s: logged.append((s, dict(m))), validation=validation,
        validation_settings=ValidationSettings(every=5, before_train=False, max_questions=2),
    )
    assert result.steps == 1 and [s for s, _ in logged] == [1] and "val/embedded/recall" in logged[0][1]
    AutoModelForCausalLM.from_pretrained(result.final_model_dir)


def test_a_bf16_rollout_copy_follows_the_trained_weights(tmp_path, native_model_dir, toy_index_dir, tiny_config):
    """``rollout_weights: bf16``: the rollout decodes from a bf16 copy, with no autocast and no boundary
    states (the update runs the frozen blocks itself); after an optimiser step the copy holds the
    trained weights in bf16, and a two-step run trains and saves as usual."""
    from spader_pipeline.native.trainer import collect_rollouts, refresh_rollout_copy, start_run
    from spader_pipeline.retrieval import load_retriever

    config = tiny_config(total_steps=2, trainable_layers=1, learning_rate=1e-2, kl_coef=0.0, rollout_weights="bf16")
    run = start_run(config, native_model_dir, tmp_path / "state")
    assert run.boundary_block is not None  # the trained model could start its update from states ...
    copy_params = dict(run.rollout_model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy_params.values())
    search = LocalSearch(load_retriever(toy_index_dir))
    rollouts = collect_rollouts(run, QUESTIONS, search, TEMPLATE, step=1)
    assert rollouts.batch.boundary is None and rollouts.batch.response_mask.sum() > 0  # ... the copy captures none
    with torch.no_grad():
        for param in run.trainable:
            param.add_(1.0)
    refresh_rollout_copy(run)
    for name, param in run.model.named_parameters():
        assert torch.equal(copy_params[name], param.detach().to(torch.bfloat16)), name

    result = _one_step(tmp_path / "run", native_model_dir, toy_index_dir, config)
    assert [h["step"] for h in result.history] == [1, 2]
    assert all(h["perf/reused_rollout_states"] == 0.0 for h in result.history)


def test_rollout_weights_are_model_or_bf16(tiny_config):
    with pytest.raises(ValueError, match="rollout_weights='fp16': use 'model' or 'bf16'"):
        tiny_config(rollout_weights="fp16")
