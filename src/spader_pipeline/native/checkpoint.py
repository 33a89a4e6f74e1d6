"""Checkpoints of the native trainer: an HF model directory, the trainer state and a manifest.

Layout of ``<run_dir>/checkpoints/step_000050/``::

    config.json, model.safetensors, tokenizer files   # loadable with AutoModelForCausalLM
    trainer_state.pt                                   # optimizer, scheduler, RNG states, step
    manifest.json                                      # every other file: size and sha256

A checkpoint is written to ``step_XXXXXX.tmp``; its files and manifest are fsynced, the folder is
renamed into place and the parent folder fsynced, so neither a killed process nor a host crash
leaves a half-written checkpoint that looks complete. Resume takes the newest checkpoint whose
files match its manifest (:func:`select_checkpoint`); damaged ones are moved aside as
``step_XXXXXX.corrupt``. The trainer state loads with ``weights_only=True``: no code runs when a
checkpoint is read, wherever it came from (docs/reliability.md).

A checkpoint records the settings its run was started with. A run whose settings or start model
differ does not resume from it and does not delete it: it stops with :class:`SettingsChanged`,
which lists each change; an explicit fresh start moves the checkpoints aside with the run's config
(:func:`supersede_checkpoints`). Nothing here deletes a run's progress silently.

The resume policy is here too, beside the format it reads: what identifies a run
(:func:`run_settings`, the trajectory-shaping settings and the start model's weights), which
checkpoint a starting run continues from (:func:`checkpoint_to_resume`) and what it restores from it
(:func:`restore_trainer_state`). The files' integrity is :mod:`.manifest`'s, the generators' states
:mod:`.rng`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spader_pipeline.native.manifest import fsync, manifest_problem, write_manifest
from spader_pipeline.native.records import history_path
from spader_pipeline.native.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from spader_pipeline.native.config import NativeTrainerConfig

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a checkpoint that cannot be loaded safely."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step_XXXXXX`` for ``step``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoint folders of a run (renamed into place, so written to the end), oldest first.

    Whether their files are intact is :func:`verify_checkpoint`'s question.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest checkpoint folder (verified or not), or ``None``."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def verify_checkpoint(folder: str | Path) -> str | None:
    """Why the checkpoint at ``folder`` is not intact (naming the file), or ``None`` when it is."""
    return manifest_problem(Path(folder), required=(STATE_FILE,))


def select_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest checkpoint of ``run_dir`` that verifies; ``None`` when the run has none.

    Each newer one that fails is renamed ``step_XXXXXX.corrupt`` (kept for inspection, never picked
    again) with a warning naming the failing file. When checkpoints exist and none verifies, raises
    :class:`CheckpointError` naming each one and why: starting afresh silently would throw away the
    run's progress, so the decision is left to the user.
    """
    for unfinished in (Path(run_dir) / "checkpoints").glob("step_*.tmp"):  # a save that was killed
        logger.info("removing the unfinished checkpoint %s", unfinished)
        shutil.rmtree(unfinished, ignore_errors=True)
    failures = []
    for step, path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return step, path
        aside = _move_aside(path)
        logger.warning("checkpoint %s is damaged: %s; moved to %s, trying the previous one", path, problem, aside.name)
        failures.append(f"{path.name} (now {aside.name}): {problem}")
    if failures:
        raise CheckpointError(
            f"no checkpoint under {Path(run_dir) / 'checkpoints'} verifies, so the run cannot resume:\n  "
            + "\n  ".join(failures)
            + "\nTo start the run afresh, set resume: false (the checkpoints then move aside, "
            "checkpoints.superseded-<time>/) or point run_dir at a new folder."
        )
    return None


def _move_aside(path: Path) -> Path:
    aside = path.with_name(path.name + ".corrupt")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.corrupt{n}"), n + 1
    os.replace(path, aside)
    return aside


# ----------------------------------------------------------------------------------------------
# Save and load
# ----------------------------------------------------------------------------------------------


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
    """Write the checkpoint of ``step`` durably and atomically, then prune to the ``keep`` newest."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    torch.save(state, tmp / STATE_FILE)
    write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync(final.parent)
    prune_checkpoints(run_dir, keep, known_good=final)  # its manifest was just made from the synced files
    return final


def prune_checkpoints(run_dir: str | Path, keep: int, *, known_good: Path | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints; return what was deleted.

    Never deletes the newest checkpoint that verifies while every newer one fails: the oldest
    candidates go only once a kept checkpoint has verified (``known_good``: one that needs no check).
    """
    found, keep = list_checkpoints(run_dir), max(keep, 1)
    kept, older = found[-keep:], found[:-keep]
    if not older:
        return []
    if not any(path == known_good or verify_checkpoint(path) is None for _, path in reversed(kept)):
        good = next((i for i in range(len(older) - 1, -1, -1) if verify_checkpoint(older[i][1]) is None), None)
        if good is None:
            return []
        logger.warning("kept checkpoint %s: no newer checkpoint verifies", older[good][1].name)
        older = older[:good]
    for _, path in older:
        shutil.rmtree(path, ignore_errors=True)
    return [path for _, path in older]


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint directory, loaded without running any code.

    ``weights_only=True``: tensors, containers and plain values only. A file that needs anything
    else (a pickle that would call a function when loaded) is refused with :class:`CheckpointError`.
    """
    file = Path(path) / STATE_FILE
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, AttributeError) as exc:
        raise CheckpointError(
            f"{file} cannot be loaded safely (weights_only=True refused it or it is damaged): {exc}"
        ) from exc


# ----------------------------------------------------------------------------------------------
# Resume: which checkpoint a run continues from, and what it restores
# ----------------------------------------------------------------------------------------------


#: the settings naming the start model (a rerun of the chain writes it again)
START_KEYS = ("start_model", "start_weights")


def weights_stamp(model_path: str | Path) -> list[list[Any]]:
    """``[name, size, mtime_ns]`` of each weights file of a model folder (safetensors, else .bin):
    which weights a run or a validation started from."""
    weights = sorted(Path(model_path).glob("*.safetensors")) or sorted(Path(model_path).glob("*.bin"))
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights]


def rollout_decoding_path(config: NativeTrainerConfig) -> dict[str, str]:
    """How this machine decodes the run's rollouts: the rollout engine (``decode.engine``) and, for our
    in-process decoder (``hf``), its path on the run's device and precision (``decode.step``,
    ``decode.attention``, ``decode.kv_cache``, ``decode.packed_weights``, ``decode.kernels``:
    :func:`~spader_pipeline.modeling.decode_step.decoding_path`). Another engine's numerics are its own."""
    from spader_pipeline.modeling.decode_step import decoding_path

    if config.engine != "hf":
        return {"decode.engine": config.engine}
    return {"decode.engine": config.engine,
            **decoding_path(config.device, config.bf16, bf16_weights=config.rollout_weights == "bf16")}


def run_settings(config: NativeTrainerConfig, model_path: str | Path) -> dict[str, Any]:
    """Identity of a run for resume, as JSON values: the settings that shape its trajectory, with the
    decoding path this machine samples them with (:func:`rollout_decoding_path`: a resume elsewhere that
    decodes otherwise is a changed setting), the start
    model's path (``start_model``) and its weights files' names, sizes and times (``start_weights``).

    Settings that only schedule, pace or place a run (steps, budget, checkpointing, logging, device,
    ``reuse_rollout_states``, ``shared_prefix``) are left out: a run may resume with other values of these.
    """
    trajectory = {k: v for k, v in config.to_dict().items()
                  if k not in ("total_steps", "max_seconds", "resume", "checkpoint_every", "keep_checkpoints",
                               "log_samples_every", "num_samples_logged", "device", "reuse_rollout_states",
                               "shared_prefix")}
    start = {"start_model": str(Path(model_path).resolve()), "start_weights": weights_stamp(model_path)}
    return json.loads(json.dumps({**trajectory, **rollout_decoding_path(config), **start}, default=str))


def settings_fingerprint(settings: Mapping[str, Any]) -> str:
    """Short hash of :func:`run_settings` (the one checkpoints of earlier versions record)."""
    trajectory = {k: v for k, v in settings.items() if k not in START_KEYS}
    blob = json.dumps([trajectory, *(settings[k] for k in START_KEYS)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def checkpoint_to_resume(config: NativeTrainerConfig, settings: dict[str, Any], run_dir: Path) -> tuple[int, Path] | None:
    """``(step, path)`` of the checkpoint this run continues from, or ``None`` for a fresh start.

    ``resume``: the newest checkpoint that verifies (docs/reliability.md), if it was written with
    these ``settings``; if only the start model differs, ``None`` after moving the checkpoints aside;
    otherwise :class:`SettingsChanged`. No ``resume``: existing checkpoints move aside first, so the
    new run neither mixes with nor prunes them.
    """
    def move_aside(why: str) -> None:
        aside = supersede_checkpoints(run_dir, with_files=("config.json", history_path(run_dir).name))
        if aside is not None:
            logger.warning("%s: the earlier checkpoints of %s moved to %s; the run starts afresh", why, run_dir, aside)

    if not config.resume:
        move_aside("resume: false")
        return None
    found = select_checkpoint(run_dir)
    if found is None:
        return None
    extra = load_trainer_state(found[1])["extra"]
    if extra.get("fingerprint") == settings_fingerprint(settings):
        return found
    recorded = extra.get("settings")
    changes = settings_changes(recorded, settings) if recorded is not None else None
    if changes and all(key.split(".")[0] in START_KEYS for key, _, _ in changes):
        # Same settings, but the start model was written again (a rerun of the chain trains the warm
        # start anew): the checkpoints continue a model that is gone, so they move aside, whole.
        move_aside(f"the start model {settings['start_model']} was written again")
        return None
    raise SettingsChanged(run_dir, found[0], changes)


def restore_trainer_state(checkpoint: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Load the optimiser, schedule and RNG states of the checkpoint at ``checkpoint``; its step."""
    state = load_trainer_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])


# ----------------------------------------------------------------------------------------------
# Checkpoints of other settings: stop with the changes, or move them aside on a fresh start
# ----------------------------------------------------------------------------------------------


NOT_SET = "(not set)"
"""the value shown for a setting one side of a comparison does not have"""

WAYS_ON = (
    "train into a new folder: set run_dir elsewhere (these checkpoints stay where they are)",
    "start afresh here: set resume: false (the checkpoints then move to checkpoints.superseded-<time>/ beside "
    "them, with the run's config.json and metrics.jsonl)",
)
"""the two ways on after :class:`SettingsChanged` with the new settings, in the trainer's own terms"""


class SettingsChanged(CheckpointError):
    """The run's checkpoints were written with other settings or another start model.

    The run stops before anything is loaded or written; the checkpoints stay as they are. ``changes``
    lists ``(setting, checkpoint's value, this run's value)``, or is ``None`` when the checkpoint does
    not record its settings (written by an older version). ``ways_on`` says how to go on with the new
    settings, in the terms of whoever started the run (:meth:`with_ways_on`).
    """

    def __init__(self, run_dir: str | Path, step: int, changes: list[tuple[str, Any, Any]] | None,
                 ways_on: Sequence[str] = WAYS_ON) -> None:
        self.run_dir, self.step, self.changes, self.ways_on = Path(run_dir), step, changes, tuple(ways_on)
        super().__init__(self._message())

    def __reduce__(self):  # pickled whole: it crosses process boundaries (child_process)
        return type(self), (self.run_dir, self.step, self.changes, self.ways_on)

    def with_ways_on(self, ways_on: Sequence[str]) -> SettingsChanged:
        """The same error with other words for the ways on."""
        return type(self)(self.run_dir, self.step, self.changes, ways_on)

    def _message(self) -> str:
        where = f"the checkpoints in {self.run_dir / 'checkpoints'} (newest: step {self.step})"
        if self.changes is None:
            what = (f"{where} were written by another configuration or start model; they do not record their "
                    "settings, so the changes cannot be listed")
        else:
            lines = "".join(f"\n  {key}: {_shown(old)} -> {_shown(new)}" for key, old, new in self.changes)
            what = f"{where} were written with other settings (setting: checkpoint's -> this run's):{lines}"
            if any(key == "start_weights" for key, _, _ in self.changes):
                what += ("\n(start_weights: the start model's weights files, [name, bytes, modification time]: "
                         "written again, e.g. by a warm start that ran again)")
        ways = "".join(f"\n  - {way}, or" for way in self.ways_on)[: -len(", or")]
        return (f"{what}\nThe run did not start and nothing was deleted. To go on, either\n"
                f"  - restore the settings they were written with, to resume from them, or{ways}.")


def _shown(value: Any) -> str:
    return value if value == NOT_SET else json.dumps(value, default=str)


def settings_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for each setting that differs, sorted by key.

    Nested mappings are compared key by key under dotted names (``reward.alpha``); a key only one
    side has shows :data:`NOT_SET` on the other.
    """
    changes = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, NOT_SET), new.get(key, NOT_SET)
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            changes += [(f"{key}.{sub}", b, a) for sub, b, a in settings_changes(before, after)]
        elif before != after:
            changes.append((key, before, after))
    return changes


def supersede_checkpoints(run_dir: str | Path, *, with_files: Sequence[str] = ()) -> Path | None:
    """Move ``<run_dir>/checkpoints`` aside as ``checkpoints.superseded-<UTC time>``, intact.

    The files ``with_files`` of ``run_dir`` (the run's config and history) are copied into it first,
    then the folder is renamed in one step: a crash leaves the checkpoints either in place or moved
    whole. Returns the new folder, or ``None`` when there was nothing to move.
    """
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if not root.is_dir() or not any(root.iterdir()):
        return None
    for name in with_files:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, root / name)
            fsync(root / name)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = run_dir / f"checkpoints.superseded-{stamp}", 1
    while aside.exists():
        aside, n = run_dir / f"checkpoints.superseded-{stamp}-{n}", n + 1
    os.replace(root, aside)
    fsync(run_dir)
    return aside
