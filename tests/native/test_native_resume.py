"""Crash and resume: a trainer subprocess killed with SIGKILL mid-run, then restarted, finishes
with the same number of steps as an uninterrupted run, also when its newest checkpoint was damaged
on disk afterwards (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from native_toy import QUESTIONS, TEMPLATE
from transformers import AutoModelForCausalLM

from spader_pipeline.native.checkpoint import list_checkpoints, load_trainer_state

TOTAL = 8


def _spec(tmp_path, model_dir, index_dir):
    samples = tmp_path / "questions.jsonl"
    samples.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    config = dict(method="spader", total_steps=TOTAL, prompts_per_step=2, group_size=2, micro_batch_size=2,
                  rollout={"max_turns": 2, "max_response_tokens": 600}, max_new_tokens=8, checkpoint_every=2,
                  keep_checkpoints=2, log_samples_every=0, options={"gamma": 0.9},
                  bf16=False)  # "auto" times a probe on CPUs: processes under load could differ
    spec = {"config": config, "model_path": str(model_dir), "samples": str(samples), "index_dir": str(index_dir),
            "run_dir": str(tmp_path / "run"), "prompt_template": TEMPLATE}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _start(spec):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "spader_pipeline.native", "--spec", str(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _kill_after_two_checkpoints(spec, run_dir):
    proc = _start(spec)
    try:
        deadline = time.monotonic() + 300
        while len(list_checkpoints(run_dir)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no second checkpoint within 300 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def _restart(spec, run_dir):
    """Run the spec again on ``run_dir``; return (result line, stderr)."""
    spec_copy = spec.with_name(f"spec-{run_dir.name}.json")
    spec_copy.write_text(json.dumps({**json.loads(spec.read_text()), "run_dir": str(run_dir)}))
    again = _start(spec_copy)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.slow
def test_sigkill_then_restart_resumes_from_the_newest_good_checkpoint_and_ends_at_the_same_step(
        tmp_path, native_model_dir, toy_index_dir):
    """Killed after two checkpoints, the run restarts intact from the newest; with the newest's weights
    or trainer state truncated (a disk fault, an unsynced write at a host crash) the restart moves it
    aside, resumes from the one before, and ends at the same step as an uninterrupted run."""
    spec = _spec(tmp_path, native_model_dir, toy_index_dir)
    killed = tmp_path / "run"
    _kill_after_two_checkpoints(spec, killed)
    (previous, _), (newest, _) = list_checkpoints(killed)[-2:]
    assert newest < TOTAL, "the run finished before it could be killed"

    intact = tmp_path / "run-intact"
    shutil.copytree(killed, intact)
    result, _ = _restart(spec, intact)
    assert result["steps"] == TOTAL and result["resumed_from"] == newest
    last_step, last_dir = list_checkpoints(intact)[-1]
    state = load_trainer_state(last_dir)
    assert last_step == state["step"] == TOTAL
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {float(TOTAL)}  # one optimizer step per global step across both processes
    model = AutoModelForCausalLM.from_pretrained(result["final_model_dir"])
    reloaded = AutoModelForCausalLM.from_pretrained(last_dir)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True))

    for name in ("model.safetensors", "trainer_state.pt"):
        run_dir = tmp_path / f"run-{name}"
        shutil.copytree(killed, run_dir)
        damaged = run_dir / "checkpoints" / f"step_{newest:06d}" / name
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
        result, err = _restart(spec, run_dir)
        assert result["steps"] == TOTAL and result["resumed_from"] == previous
        assert f"step_{newest:06d}" in err and name in err  # the warning names the checkpoint and file
        assert (run_dir / "checkpoints" / f"step_{newest:06d}.corrupt").is_dir()
        history = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert history == list(range(1, TOTAL + 1))
        replayed = AutoModelForCausalLM.from_pretrained(result["final_model_dir"])
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), replayed.state_dict().values(),
                                                     strict=True))  # the same weights as without the damage
