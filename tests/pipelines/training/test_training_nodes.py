from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.pipelines.training.nodes import _summary, method_run_identity, train_policy, warm_start
from spader_pipeline.training import TrainingSettings
from spader_pipeline.typed_config import method_settings


def _verl_frame(n=5):
    return pd.DataFrame([
        {"prompt": [], "data_source": "embedded", "agent_name": "spader_search",
         "reward_model": {"ground_truth": np.array([np.array(["Ghana", "Republic of Ghana"]), np.array(["Mali"])], dtype=object),
                          "style": "rule"},
         "extra_info": {"index": i, "id": f"q{i}", "split": "train", "question": f"Question {i}?"}}
        for i in range(n)
    ])


def test_samples_from_verl_reads_questions_and_alias_lists_from_parquet_rows():
    samples = samples_from_verl(_verl_frame())
    assert samples[0] == {"id": "q0", "question": "Question 0?", "ground_truth": [["Ghana", "Republic of Ghana"], ["Mali"]],
                          "data_source": "embedded"}
    subset = samples_from_verl(_verl_frame(), limit=3, seed=1)
    assert len(subset) == 3 and subset == samples_from_verl(_verl_frame(), limit=3, seed=1)


def test_disabled_warm_start_passes_the_base_model_through():
    manifest, metrics = warm_start({"path": "/models/qwen3"}, _verl_frame(), _verl_frame(), {}, {"enabled": False}, {})
    assert manifest == {"path": "/models/qwen3", "warm_start": False} and metrics == {}


def test_method_block_overrides_shared_settings_key_by_key():
    training = {"reward": {"tool_round_cost": 0.01, "format_penalty": 0.0}, "native": {"seed": 0}}
    merged = method_settings(training, {"method": "spader", "reward": {"beta": 4.0}}, "native")
    assert merged == {"reward": {"tool_round_cost": 0.01, "format_penalty": 0.0, "beta": 4.0}, "seed": 0, "method": "spader"}


def test_summary_averages_the_last_steps():
    history = [{"step": s, "method_reward/mean": float(s), "perf/step_seconds": 2.0} for s in range(1, 21)]
    out = _summary(history, window=10)
    assert out["last10/method_reward/mean"] == pytest.approx(15.5) and out["steps"] == 20 and out["seconds"] == 40


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match=r"training.backend='tpu': use one of \['native', 'verl'\]"):
        train_policy({"path": "x"}, _verl_frame(), {}, {"method": "grpo"}, {"backend": "tpu"},
                     {"template": "t", "templates": {"t": "{question}"}})


def test_the_method_runs_parameters_name_the_decoding_path():
    """How this machine decodes the rollouts, at the trainer's device and precision (decode_step.decoding_path)."""
    from spader_pipeline.modeling.decode_step import decoding_path

    settings = TrainingSettings.from_mapping({"native": {"device": "cpu", "bf16": False}}, {"method": "grpo"})
    _, _, params = method_run_identity({"path": "/models/start"}, settings)
    assert {key: value for key, value in params.items() if key.startswith("decode.")} == {
        "decode.engine": "hf", **decoding_path("cpu", False)}
    assert params["decode.step"] == "transformers" and params["decode.kv_cache"] == "fp32"  # no autocast
    verl = TrainingSettings.from_mapping({"backend": "verl"}, {"method": "grpo"})
    _, _, params = method_run_identity({"path": "/models/start"}, verl)
    assert not any(key.startswith("decode.") for key in params)  # verl's rollout server is verl's
