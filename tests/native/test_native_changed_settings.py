"""A run restarted with other settings never deletes its checkpoints (docs/reliability.md).

A real run of the tiny model is stopped after two checkpoints, then restarted with another learning
rate: by default it stops, naming the setting and the ways on, with every checkpoint untouched; with
``resume: false`` the old checkpoints move aside whole, with their config and history, and the new
run trains. The Kedro training node stops the same way, naming the ways on in Kedro's terms.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pandas as pd
import pytest
from native_toy import QUESTIONS, TEMPLATE

from spader_pipeline.native import train_native
from spader_pipeline.native.checkpoint import (
    NOT_SET,
    SettingsChanged,
    list_checkpoints,
    load_trainer_state,
    settings_changes,
    verify_checkpoint,
)
from spader_pipeline.native.manifest import MANIFEST_FILE

OLD_LR, NEW_LR = 1e-4, 3e-4
METHOD = {"method": "spader", "options": {"gamma": 0.9}}


def _training(**native):
    """``params:training`` of a tiny native run (bf16 off: "auto" decides by the CPU; these tests are
    about files, not precision)."""
    settings = {"total_steps": 4, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2, "max_new_tokens": 10,
                "rollout": {"max_turns": 2, "max_response_tokens": 600}, "learning_rate": OLD_LR, "bf16": False,
                "checkpoint_every": 1, "keep_checkpoints": 2, "log_samples_every": 0, **native}
    return {"backend": "native", "subprocess": False, "native": settings, "reward": {"cost_free_steps": 0},
            "search": {"mode": "local"}}


def _train(run_dir, index_dir, model_dir, training, stop_after=None):
    """The native trainer on the toy questions, configured as the training node configures it."""
    from spader_pipeline.native import NativeTrainerConfig
    from spader_pipeline.retrieval import load_retriever
    from spader_pipeline.retrieval.service import LocalSearch
    from spader_pipeline.typed_config import method_settings

    config = NativeTrainerConfig.from_mapping(method_settings(training, METHOD, "native"))
    return train_native(config, model_path=model_dir, samples=QUESTIONS, search=LocalSearch(load_retriever(index_dir)),
                        run_dir=run_dir, prompt_template=TEMPLATE, stop_after=stop_after)


def _snapshot(folder):
    """The manifest (sizes and sha256 of every file) of each checkpoint in ``folder``, by its name."""
    return {path.name: (path / MANIFEST_FILE).read_text() for path in sorted(folder.glob("step_*"))}


@pytest.fixture
def stopped_run(tmp_path, native_model_dir, toy_index_dir):
    """A run of 4 steps stopped after its checkpoints of steps 1 and 2, where the node puts it."""
    run_dir = tmp_path / "models" / "train_spader"
    result = _train(run_dir, toy_index_dir, native_model_dir, _training(), stop_after=2)
    assert result.steps == 2 and [s for s, _ in list_checkpoints(run_dir)] == [1, 2]
    return run_dir


def test_settings_changes_name_each_nested_setting_that_differs():
    old = {"learning_rate": 1e-4, "reward": {"alpha": 1.0, "beta": 4.0}, "seed": 0, "gone": 1}
    new = {"learning_rate": 3e-4, "reward": {"alpha": 1.0, "beta": 2.0}, "seed": 0, "added": True}
    assert settings_changes(old, new) == [("added", NOT_SET, True), ("gone", 1, NOT_SET),
                                          ("learning_rate", 1e-4, 3e-4), ("reward.beta", 4.0, 2.0)]
    assert settings_changes(old, old) == []


def test_a_changed_setting_stops_the_run_naming_it_and_keeps_every_checkpoint(stopped_run, native_model_dir,
                                                                              toy_index_dir):
    before = _snapshot(stopped_run / "checkpoints")
    with pytest.raises(SettingsChanged) as stopped:
        _train(stopped_run, toy_index_dir, native_model_dir, _training(learning_rate=NEW_LR))
    error = stopped.value
    assert error.changes == [("learning_rate", OLD_LR, NEW_LR)] and error.step == 2
    message = str(error)
    assert "learning_rate: 0.0001 -> 0.0003" in message and "nothing was deleted" in message
    assert "set run_dir elsewhere" in message and "set resume: false" in message  # the two ways on
    assert str(pickle.loads(pickle.dumps(error))) == message  # it crosses from a child process whole

    assert _snapshot(stopped_run / "checkpoints") == before
    assert all(verify_checkpoint(path) is None for _, path in list_checkpoints(stopped_run))
    assert json.loads((stopped_run / "config.json").read_text())["learning_rate"] == OLD_LR
    assert [json.loads(line)["step"] for line in (stopped_run / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    # schedule settings are not changes: the same run resumes with another step count
    resumed = _train(stopped_run, toy_index_dir, native_model_dir, _training(total_steps=3))
    assert resumed.resumed_from == 2 and resumed.steps == 3


def test_a_resume_that_would_decode_otherwise_stops_naming_the_decoding_path(stopped_run, native_model_dir,
                                                                           toy_index_dir, monkeypatch):
    """The checkpoints record how this machine decoded the rollouts (modeling/decode_step.py:decoding_path);
    a resume where it decodes otherwise (here: as if the C++ step did not build) is a changed setting."""
    from spader_pipeline.modeling import decode_step

    recorded = load_trainer_state(list_checkpoints(stopped_run)[-1][1])["extra"]["settings"]
    path = {key: value for key, value in recorded.items() if key.startswith("decode.") and key != "decode.engine"}
    assert set(path) == {"decode.step", "decode.attention", "decode.kv_cache", "decode.packed_weights", "decode.kernels"}
    assert recorded["decode.engine"] == "hf"
    other = {**path, "decode.attention": "sdpa" if path["decode.attention"] == "cpp" else "cpp"}
    monkeypatch.setattr(decode_step, "decoding_path", lambda *args, **kwargs: other)
    with pytest.raises(SettingsChanged) as stopped:
        _train(stopped_run, toy_index_dir, native_model_dir, _training())
    assert stopped.value.changes == [("decode.attention", path["decode.attention"], other["decode.attention"])]


def test_a_fresh_start_moves_the_old_checkpoints_aside_whole_with_their_config(stopped_run, native_model_dir,
                                                                             toy_index_dir):
    before = _snapshot(stopped_run / "checkpoints")
    result = _train(stopped_run, toy_index_dir, native_model_dir,
                    _training(learning_rate=NEW_LR, total_steps=2, resume=False))
    assert result.resumed_from is None and result.steps == 2

    (aside,) = stopped_run.glob("checkpoints.superseded-*")
    assert _snapshot(aside) == before and len(before) == 2
    for name in before:
        assert verify_checkpoint(aside / name) is None
        assert load_trainer_state(aside / name)["extra"]["settings"]["learning_rate"] == OLD_LR
    assert json.loads((aside / "config.json").read_text())["learning_rate"] == OLD_LR
    assert [json.loads(line)["step"] for line in (aside / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    # the new run's own checkpoints, config and history
    assert [s for s, _ in list_checkpoints(stopped_run)] == [1, 2]
    assert load_trainer_state(list_checkpoints(stopped_run)[-1][1])["extra"]["settings"]["learning_rate"] == NEW_LR
    assert json.loads((stopped_run / "config.json").read_text())["learning_rate"] == NEW_LR


def test_the_training_node_stops_with_the_changes_and_the_ways_on_in_kedro_terms(stopped_run, native_model_dir,
                                                                                toy_index_dir):
    """Through ``train_policy`` as ``kedro run`` calls it (in-process, ``training.subprocess: false``: from
    the child process the error comes back pickled, which the test above checks)."""
    from spader_pipeline.pipelines.training.nodes import train_policy

    before = _snapshot(stopped_run / "checkpoints")
    verl_train = pd.DataFrame([
        {"prompt": [], "data_source": "embedded", "agent_name": "spader_search",
         "reward_model": {"ground_truth": np.array([np.array(t, dtype=object) for t in q["ground_truth"]], dtype=object),
                          "style": "rule"},
         "extra_info": {"index": i, "id": q["id"], "split": "train", "question": q["question"]}}
        for i, q in enumerate(QUESTIONS)
    ])
    training = {**_training(learning_rate=NEW_LR), "output_dir": str(stopped_run.parent)}
    with pytest.raises(SettingsChanged) as stopped:
        train_policy({"path": str(native_model_dir)}, verl_train, {"index_dir": str(toy_index_dir)}, METHOD, training,
                     {"template": "t", "templates": {"t": TEMPLATE}})
    message = str(stopped.value)
    assert "learning_rate: 0.0001 -> 0.0003" in message
    assert "training.output_dir" in message and "--params training.native.resume=false" in message
    assert _snapshot(stopped_run / "checkpoints") == before


def test_a_start_model_written_again_moves_the_checkpoints_aside_and_starts_afresh(native_model_dir, toy_index_dir,
                                                                                   tmp_path):
    """A second ``make run`` trains the warm start again in place: same settings, new weights files.
    The old checkpoints continue a model that is gone, so they move aside (not a stop, not a delete)."""
    import shutil
    import time

    start = tmp_path / "start_model"
    shutil.copytree(native_model_dir, start)
    run_dir = tmp_path / "rewritten" / "train_spader"
    _train(run_dir, toy_index_dir, start, _training(), stop_after=2)
    before = _snapshot(run_dir / "checkpoints")
    time.sleep(0.01)
    for weights in start.glob("*.safetensors"):  # written again: same bytes, a new modification time
        weights.write_bytes(weights.read_bytes())
    result = _train(run_dir, toy_index_dir, start, _training(total_steps=1))
    assert result.resumed_from is None and result.steps == 1
    [aside] = list(run_dir.glob("checkpoints.superseded-*"))
    assert _snapshot(aside) == before and (aside / "config.json").is_file()
