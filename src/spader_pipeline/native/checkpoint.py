"""Checkpoints of the native trainer: an HF model directory plus the trainer state.

Layout of ``<run_dir>/checkpoints/step_000050/``::

    config.json, model.safetensors, tokenizer files   # loadable with AutoModelForCausalLM
    trainer_state.pt                                   # optimizer, scheduler, RNG states, step

A checkpoint is written to ``step_XXXXXX.tmp`` and renamed when complete, so a process killed
while saving (SIGKILL, OOM) never leaves a half-written checkpoint that resume would pick up.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest complete checkpoint, or ``None``."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write the checkpoint of ``step`` atomically; delete all but the ``keep`` newest."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    torch.save(state, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint directory."""
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
