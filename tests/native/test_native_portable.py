"""The portable run (a bundle, no Kedro or MLflow): warm start → RL per method → held-out records and
summary, on the tiny model and the toy index. The CPU variant runs in CI; the ``gpu`` variant is the
same run on CUDA (the GPU check machine, docs/gpu.md)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from native_toy import QUESTIONS, TEMPLATE

from spader_pipeline.portable.bundle import export_bundle, read_settings, with_overrides
from spader_pipeline.portable.run import run_bundle
from spader_pipeline.reporting.portable import environment, summarise, summary_markdown

ROLLOUT = {"max_turns": 2, "max_response_tokens": 600, "topk": 2}


def _settings() -> dict:
    """Tiny settings in the bundle's layout (the Kedro blocks, as conf/test sizes them)."""
    return {
        "warm_start": {"enabled": True, "seed": 0, "max_demonstrations": None, "check_questions": 0,
                       "scripted": {"query_style": "fixed", "max_searches": 1}, "rollout": ROLLOUT, "max_length": 512,
                       "sft": {"max_steps": 2, "schedule_steps": None, "batch_tokens": 1024, "warmup_steps": 1,
                               "log_every": 1, "bf16": False}},
        "training": {"max_train_questions": None, "rollout": ROLLOUT,
                     "reward": {"cost_free_steps": 0},
                     "validation": {"every": 2, "before_train": True, "max_questions": 2},
                     "native": {"total_steps": 2, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2,
                                "max_new_tokens": 10, "rollout": ROLLOUT, "checkpoint_every": 1,
                                "log_samples_every": 0, "bf16": False}},
        "methods": {"grpo": {"method": "grpo", "reward": {"tool_round_cost": 0.0}, "options": {}},
                    "spader": {"method": "spader", "reward": {"tool_round_cost": 0.01}, "options": {"gamma": 0.9}}},
        "evaluation": {"sampling": {"temperature": 0.0, "max_new_tokens": 10}, "rollout": ROLLOUT, "batch_size": 3,
                       "max_prompt_tokens": None},
        "bootstrap": {"resamples": 100, "confidence": 0.95, "seed": 0},
        "base_model": {"path": "base_model"},
        "heldout": "toy_test",
        "prompt_template": TEMPLATE,
    }


def _verl_frame() -> pd.DataFrame:
    return pd.DataFrame([
        {"prompt": [], "data_source": "embedded", "agent_name": "spader_search", "ability": "multi_answer_search",
         "reward_model": {"style": "rule", "ground_truth": [list(e) for e in q["ground_truth"]]},
         "extra_info": {"index": i, "id": q["id"], "split": "train", "question": q["question"]}}
        for i, q in enumerate(QUESTIONS)
    ])


@pytest.fixture
def bundle(tmp_path, native_model_dir, toy_index_dir):
    heldout = pd.DataFrame([{**q, "data_source": "embedded", "split": "test"} for q in QUESTIONS])
    return export_bundle(tmp_path / "bundle", _settings(), verl_train=_verl_frame(), verl_validation=_verl_frame(),
                         heldout=heldout, index_dir=toy_index_dir, base_model_dir=native_model_dir)


def _check_run(bundle, out, device: str, *, parallel_methods: bool = False) -> dict:
    summary = run_bundle(bundle, out, device=device, parallel_methods=parallel_methods)
    assert summary["failed_methods"] == {}
    assert set(summary["models"]) == {"warm_start", "grpo", "spader"}
    assert summary["steps"] == {"grpo": 2, "spader": 2} and summary["questions"] == len(QUESTIONS)
    assert summary["environment"]["device"] == device
    for method in ("grpo", "spader"):
        entry = summary["models"][method]
        assert entry["failed"] == 0 and set(entry["recall_minus_warm_start"]) >= {"mean", "low", "high"}
        assert (out / f"train_{method}" / "final" / "config.json").is_file()
    records = [json.loads(line) for line in (out / "heldout_records.jsonl").read_text().splitlines()]
    assert len(records) == 3 * len(QUESTIONS) and {r["model"] for r in records} == {"warm_start", "grpo", "spader"}
    curves = json.loads((out / "curves.json").read_text())
    # step 0 (the warm start's validation, shared), then steps 1 and 2, validated at step 2
    assert [h["step"] for h in curves["grpo"]] == [0, 1, 2] and "val/embedded/recall" in curves["grpo"][2]
    assert (out / "summary.md").read_text().startswith("| model |") and (out / "curves.png").stat().st_size > 0
    return summary


@pytest.mark.heavy
@pytest.mark.slow
def test_a_bundle_runs_end_to_end_on_the_cpu(bundle, tmp_path):
    """The methods side by side, one spawned process each (the GPU run's way); the sequential way is
    the same function in-process (the ``gpu`` variant below)."""
    assert read_settings(bundle)["base_model"] == {"path": "base_model"}
    summary = _check_run(bundle, tmp_path / "out", "cpu", parallel_methods=True)
    assert {"train_grpo", "evaluate_grpo", "train_spader", "evaluate_spader"} <= set(summary["seconds"])


@pytest.mark.gpu
def test_a_bundle_runs_end_to_end_on_cuda(bundle, tmp_path):  # pragma: no cover - needs a GPU
    assert torch.cuda.is_available()
    _check_run(bundle, tmp_path / "out", "cuda")
    log = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert log["environment"]["device_name"] == torch.cuda.get_device_name(0)


def test_the_environment_names_the_decoding_path():
    """The summary's environment: versions, and how the rollouts were decoded (decode_step.decoding_path)."""
    from spader_pipeline.modeling.decode_step import decoding_path

    shown = environment("cpu", True)
    assert {"device", "torch", "transformers", "python"} <= set(shown)
    assert {key: value for key, value in shown.items() if key.startswith("decode.")} == decoding_path("cpu", True)
    assert environment("cpu", True, bf16_weights=True)["decode.step"] == "transformers"


def test_overrides_set_dotted_keys_and_reject_unknown_blocks():
    settings = with_overrides(_settings(), {"training.native.total_steps": 5, "evaluation.batch_size": 1})
    assert settings["training"]["native"]["total_steps"] == 5 and settings["evaluation"]["batch_size"] == 1
    assert _settings()["training"]["native"]["total_steps"] == 2  # a copy
    with pytest.raises(KeyError, match="no block 'nope'"):
        with_overrides(_settings(), {"nope.x": 1})


def test_summary_pairs_each_model_with_the_reference_question_by_question():
    def rows(model, recalls, status="ok"):
        return [{"model": model, "id": f"q{i}", "status": status, "recall": r, "f1": r, "num_searches": 1}
                for i, r in enumerate(recalls)]

    records = rows("warm_start", [0.0, 0.5, 1.0]) + rows("grpo", [0.5, 0.5, 1.0]) + rows("broken", [1.0, 1.0, 1.0], "failed")
    summary = summarise(records, {"resamples": 200}, reference="warm_start")
    grpo = summary["models"]["grpo"]
    assert grpo["recall"]["mean"] == pytest.approx(2.0 / 3)
    assert grpo["recall_minus_warm_start"]["mean"] == pytest.approx(0.5 / 3)
    assert np.isclose(grpo["recall_minus_warm_start"]["low"], 0.0) or grpo["recall_minus_warm_start"]["low"] > 0
    broken = summary["models"]["broken"]
    assert broken["failed"] == 3 and broken["recall"]["mean"] == 0.0  # a failed question scores 0
    assert "recall_minus_warm_start" not in summary["models"]["warm_start"]


def test_a_model_whose_every_question_failed_scores_zero():
    """Failed records carry the question and the error, no metrics (evaluation.runner.failure_record)."""
    ok = [{"model": "warm_start", "id": f"q{i}", "status": "ok", "recall": 0.5, "f1": 0.5, "num_searches": 1}
          for i in range(3)]
    failed = [{"model": "grpo", "id": f"q{i}", "status": "failed", "error": "search failed", "attempts": 2}
              for i in range(3)]
    for records in (ok + failed, failed):
        summary = summarise(records, {"resamples": 50}, reference="warm_start")
        grpo = summary["models"]["grpo"]
        assert grpo["failed"] == 3 and grpo["recall"]["mean"] == 0.0 and np.isnan(grpo["searches"])
    assert summarise(ok + failed, {"resamples": 50}, reference="warm_start")["models"]["grpo"][
        "recall_minus_warm_start"]["mean"] == pytest.approx(-0.5)


def test_the_summary_counts_questions_compares_the_trained_models_and_tabulates_each_step():
    """Per trained model the questions it got better / worse / the same on against the reference, the
    later trained model against the earlier one on the same questions, the held-out mechanism means; the
    markdown carries them, the stages' seconds and one row per method and RL step (– where a metric is missing)."""
    def rows(model, recalls):
        return [{"model": model, "id": f"q{i}", "status": "ok", "recall": r, "f1": r, "num_searches": 2,
                 "precision": 0.5, "seen_recall": 0.75, "answered_given_seen": r}
                for i, r in enumerate(recalls)]

    # the methods' records in the order they finished (SPADER first), the summary in the run's order of methods
    records = rows("warm_start", [0.0, 0.5, 1.0, 0.5]) + rows("spader", [1.0, 1.0, 1.0, 1.0]) + rows("grpo", [0.5, 0.5, 0.5, 1.0])
    summary = summarise(records, {"resamples": 200}, reference="warm_start", order=["grpo", "spader"])
    assert list(summary["models"]) == ["warm_start", "grpo", "spader"]
    assert summary["models"]["grpo"]["questions"] == {"better": 2, "worse": 1, "same": 1}
    assert summary["models"]["spader"]["questions"] == {"better": 3, "worse": 0, "same": 1}
    assert "questions" not in summary["models"]["warm_start"]
    assert list(summary["pairs"]) == ["spader_minus_grpo"]
    assert summary["pairs"]["spader_minus_grpo"]["recall"]["mean"] == pytest.approx(1.0 - 2.5 / 4)
    assert summary["models"]["grpo"]["mechanism"] == {"precision": 0.5, "seen_recall": 0.75,
                                                      "answered_given_seen": pytest.approx(2.5 / 4)}
    summary.update(seconds={"warm_start": 39.06, "train_grpo": 218.3}, methods=["grpo", "spader"])
    curves = {"spader": [{"step": 1, "answer/recall": 0.2}],
              "grpo": [{"step": 0, "val/embedded/recall": 0.1},
                       {"step": 1, "answer/recall": 0.18, "policy/entropy": 0.33, "perf/step_seconds": 32.4,
                        "perf/rollout_prefill_seconds": 4.25, "perf/rollout_decode_steps": 567.0}]}
    shown = summary_markdown(summary, curves)
    assert "| grpo | 0.625 [" in shown and "| 2 / 1 / 1 |" in shown and "spader − grpo, paired" in shown
    assert "| warm_start | 39.1 |" in shown
    step_rows = [line for line in shown.splitlines() if line.startswith(("| grpo | 1 |", "| spader | 1 |"))]
    assert step_rows[0] == "| grpo | 1 | 0.180 | 0.330 | – | – | – | 32.4 | – | – | 4.2 | – | – | 567 | – |"
    assert step_rows[1].startswith("| spader | 1 | 0.200 | – |")  # the methods' order, not the curves
