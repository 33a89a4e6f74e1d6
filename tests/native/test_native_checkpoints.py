"""Checkpoints that verify, and loads that never run code (docs/reliability.md).

Real checkpoints of the tiny model written by :func:`save_checkpoint`, then damaged on disk the
way a disk fault or an unsynced write at a host crash leaves them.
"""

from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest
import torch

from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.native.checkpoint import (
    STATE_FILE,
    CheckpointError,
    SettingsChanged,
    list_checkpoints,
    load_trainer_state,
    prune_checkpoints,
    save_checkpoint,
    select_checkpoint,
    verify_checkpoint,
)
from spader_pipeline.native.manifest import MANIFEST_FILE, write_manifest
from spader_pipeline.native.rng import rng_state, set_rng_state


@pytest.fixture
def two_checkpoints(tmp_path, native_model_dir):
    """Checkpoints of steps 1 and 2 (keep 3) of a real optimizer over the tiny model."""
    model, tokenizer = load_model_and_tokenizer(native_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for step in (1, 2):
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        scheduler.step()
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, scheduler, extra={"fingerprint": "f"}, keep=3)
    return tmp_path


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_lists_every_file_with_size_and_sha256(two_checkpoints):
    _, newest = list_checkpoints(two_checkpoints)[-1]
    files = json.loads((newest / MANIFEST_FILE).read_text())["files"]
    assert {STATE_FILE, "model.safetensors", "config.json"} <= set(files)
    assert files[STATE_FILE]["size"] == (newest / STATE_FILE).stat().st_size
    assert len(files[STATE_FILE]["sha256"]) == 64
    assert verify_checkpoint(newest) is None
    assert not list(newest.parent.glob("*.tmp"))


@pytest.mark.parametrize(("name", "damage"), [
    ("model.safetensors", _truncate), (STATE_FILE, _truncate), ("model.safetensors", _flip_byte),
    ("config.json", _flip_byte), (MANIFEST_FILE, os.remove),
])
def test_resume_skips_a_damaged_newest_checkpoint_and_moves_it_aside(two_checkpoints, caplog, name, damage):
    newest = list_checkpoints(two_checkpoints)[-1][1]
    damage(newest / name)
    with caplog.at_level(logging.WARNING):
        step, path = select_checkpoint(two_checkpoints)
    assert step == 1 and path.name == "step_000001"
    assert not newest.exists() and (newest.parent / "step_000002.corrupt" / "model.safetensors").exists()
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "step_000002" in warning and name in warning
    assert load_trainer_state(path)["step"] == 1
    (newest.parent / "step_000003.tmp").mkdir()  # a save killed half-way
    assert select_checkpoint(two_checkpoints)[0] == 1  # the one moved aside is never picked again
    assert not (newest.parent / "step_000003.tmp").exists()


def test_every_checkpoint_damaged_stops_with_one_error_naming_each(two_checkpoints):
    (first, _), (second, _) = [(p, s) for s, p in list_checkpoints(two_checkpoints)]
    _truncate(first / "model.safetensors")
    _truncate(second / STATE_FILE)
    with pytest.raises(CheckpointError) as error:
        select_checkpoint(two_checkpoints)
    message = str(error.value)
    assert "step_000001" in message and "model.safetensors" in message
    assert "step_000002" in message and STATE_FILE in message
    assert select_checkpoint(two_checkpoints / "elsewhere") is None  # no checkpoints at all: a fresh run


def test_pruning_keeps_the_last_good_checkpoint_while_the_newer_ones_fail(two_checkpoints):
    _flip_byte(list_checkpoints(two_checkpoints)[-1][1] / "model.safetensors")
    assert prune_checkpoints(two_checkpoints, keep=1) == []
    assert [s for s, _ in list_checkpoints(two_checkpoints)] == [1, 2]
    write_manifest(list_checkpoints(two_checkpoints)[-1][1])  # the newest verifies again
    assert [p.name for p in prune_checkpoints(two_checkpoints, keep=1)] == ["step_000001"]


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    torch.save({"rng": rng_state()}, tmp_path / "s.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


class _RunsACommand:
    """A pickle payload: unpickling it calls ``os.system`` (what a planted trainer_state.pt does)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_trainer_state_that_would_run_code_is_refused_and_nothing_runs(two_checkpoints, tmp_path_factory,
                                                                         native_model_dir, tiny_config):
    from spader_pipeline.native.trainer import start_run

    marker = tmp_path_factory.mktemp("marker") / "pwned"
    newest = list_checkpoints(two_checkpoints)[-1][1]
    torch.save({"step": 2, "extra": {"fingerprint": _RunsACommand(marker)}}, newest / STATE_FILE)
    write_manifest(newest)  # a planted file with a matching manifest (a checkpoint "from elsewhere")
    assert verify_checkpoint(newest) is None
    with pytest.raises(CheckpointError, match="weights_only"):
        load_trainer_state(newest)
    with pytest.raises(CheckpointError, match=STATE_FILE):
        start_run(tiny_config(), native_model_dir, two_checkpoints)
    assert not marker.exists()


def test_checkpoints_that_do_not_record_their_settings_stop_a_run_of_other_settings(two_checkpoints,
                                                                                   native_model_dir, tiny_config):
    """Checkpoints of an earlier version (a fingerprint, no settings): the changes cannot be listed,
    the run still stops and deletes nothing."""
    from spader_pipeline.native.trainer import start_run

    with pytest.raises(SettingsChanged, match="do not record their settings") as stopped:
        start_run(tiny_config(bf16=False), native_model_dir, two_checkpoints)
    assert stopped.value.changes is None and "resume: false" in str(stopped.value)
    assert [s for s, _ in list_checkpoints(two_checkpoints)] == [1, 2]
    assert not (two_checkpoints / "config.json").exists()  # stopped before writing anything
