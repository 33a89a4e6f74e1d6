"""One verl ``fit()`` in a process of its own (what a user's training job is), for the tests that kill it.

    python verl_fit_child.py CONFIG.yaml RUN_DIR WORLD_SIZE [--die-after-checkpoint STEP]

Runs the composed ``CONFIG.yaml`` with verl's real workers on the CPU platform (``WORLD_SIZE`` ranks) and,
before its Ray session ends, writes what each replica's rollout server holds: ``server_<rank>.json``
(its records) and ``server_<rank>.pt`` (its weights, bf16). With ``--die-after-checkpoint STEP`` the
trainer writes the servers' records right after saving the checkpoint of ``STEP`` and then the whole
process group is killed (SIGKILL: no cleanup, as when a node is lost).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import ray
import torch
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from verl_loop_support import local_ray, run_fit  # noqa: E402


def dump_servers(run_dir: Path, replicas: int, *, weights: bool = True) -> None:
    from spader_pipeline.verl_plugin.decoder_rollout import server_actor_name

    for rank in range(replicas):
        server = ray.get_actor(server_actor_name(rank))
        (run_dir / f"server_{rank}.json").write_text(json.dumps(ray.get(server.stats.remote())))
        if weights:
            held = ray.get(server.__ray_call__.remote(
                lambda s: {k: v.detach().to(torch.bfloat16).clone() for k, v in s.model.state_dict().items()}))
            torch.save(held, run_dir / f"server_{rank}.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("world_size", type=int)
    parser.add_argument("--die-after-checkpoint", type=int, default=None)
    args = parser.parse_args(argv)
    config = OmegaConf.load(args.config)

    from verl.trainer import main_ppo_v0
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    class DiesAfterItsCheckpoint(RayPPOTrainer):
        def _save_checkpoint(self):
            super()._save_checkpoint()
            if self.global_steps == args.die_after_checkpoint:
                dump_servers(args.run_dir, args.world_size, weights=False)
                os.killpg(0, signal.SIGKILL)

    if args.die_after_checkpoint is not None:
        main_ppo_v0.RayPPOTrainer = DiesAfterItsCheckpoint
    with local_ray(gpus=args.world_size, cpu_platform=True):
        run_fit(config, args.run_dir, before_cleanup=lambda: dump_servers(args.run_dir, args.world_size))


if __name__ == "__main__":
    main()
