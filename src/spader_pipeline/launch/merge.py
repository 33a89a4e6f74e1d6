"""VERL FSDP actor checkpoints → Hugging Face model directories.

VERL saves the actor as ``<run>/checkpoints/global_step_N/actor/`` with one
``model_world_size_W_rank_R.pt`` shard per rank, ``fsdp_config.json`` and a ``huggingface/``
folder (config + tokenizer). VERL's own merger turns that into a loadable HF directory:

    python -m verl.model_merger merge --backend fsdp --local_dir <actor> --target_dir <out>

:func:`merge_fsdp_checkpoint` runs exactly that command (streamed, failures raise with the log tail).
Native-trainer checkpoints are already HF directories and need no merge.
"""

from __future__ import annotations

import sys
from pathlib import Path

from spader_pipeline.launch.command import verl_environment
from spader_pipeline.launch.process import VerlLaunchError, run_streaming


def merge_command(actor_dir: str | Path, target_dir: str | Path, *, python: str | None = None) -> list[str]:
    """The ``verl.model_merger`` command line for an FSDP actor directory."""
    return [python or sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
            "--local_dir", str(Path(actor_dir).resolve()), "--target_dir", str(Path(target_dir).resolve())]


def merge_fsdp_checkpoint(actor_dir: str | Path, target_dir: str | Path, *, timeout: float | None = None) -> Path:
    """Merge one FSDP actor checkpoint into ``target_dir``; return it (raises on failure)."""
    actor_dir, target_dir = Path(actor_dir), Path(target_dir)
    if not (actor_dir / "fsdp_config.json").is_file():
        raise FileNotFoundError(f"{actor_dir} is not a VERL FSDP actor checkpoint (no fsdp_config.json)")
    target_dir.mkdir(parents=True, exist_ok=True)
    run_streaming(merge_command(actor_dir, target_dir), verl_environment(tracking_uri=None, run_id=None),
                  target_dir / "merge.log", timeout=timeout)
    if not (target_dir / "config.json").is_file():
        raise VerlLaunchError(f"the merger finished but {target_dir} has no config.json")
    return target_dir
