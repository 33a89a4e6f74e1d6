"""Crash and resume: a trainer subprocess killed with SIGKILL mid-run, then restarted, finishes
with the same number of steps as an uninterrupted run."""

from __future__ import annotations

import json
import os
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
                  keep_checkpoints=2, log_samples_every=0, options={"gamma": 0.9})
    spec = {"config": config, "model_path": str(model_dir), "samples": str(samples), "index_dir": str(index_dir),
            "run_dir": str(tmp_path / "run"), "prompt_template": TEMPLATE}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _start(spec):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "spader_pipeline.native", "--spec", str(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_sigkill_mid_training_then_restart_resumes_and_ends_at_the_same_step(tmp_path, native_model_dir, toy_index_dir):
    spec = _spec(tmp_path, native_model_dir, toy_index_dir)
    run_dir = tmp_path / "run"
    proc = _start(spec)
    try:
        deadline = time.monotonic() + 300
        while not list_checkpoints(run_dir):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    killed_at = list_checkpoints(run_dir)[-1][0]
    assert killed_at < TOTAL, "the run finished before it could be killed"

    again = _start(spec)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["steps"] == TOTAL and result["resumed_from"] >= killed_at >= 2

    last_step, last_dir = list_checkpoints(run_dir)[-1]
    state = load_trainer_state(last_dir)
    assert last_step == state["step"] == TOTAL
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {float(TOTAL)}  # one optimizer step per global step across both processes
    history = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert history == list(range(1, TOTAL + 1))
    model = AutoModelForCausalLM.from_pretrained(result["final_model_dir"])
    reloaded = AutoModelForCausalLM.from_pretrained(last_dir)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True))
