"""A verl run on the CPU killed after its first checkpoint resumes at the next step, and its 2-rank FSDP2
checkpoint goes through the ``merge`` pipeline into the actor's weights.

Each run is a process of its own (:mod:`verl_fit_child`, verl's real workers, two FSDP2 ranks on gloo,
two replicas of our rollout server). The first saves a checkpoint every step (``trainer.save_freq=1``)
and its process group is SIGKILLed right after the step-1 checkpoint. The second, the same command
with ``trainer.resume_mode=auto``, must start at step 2 from the step-1 weights (the first weights its
servers receive are the ones the killed run's servers held) and save step 2. A real ``kedro run
--pipeline merge`` then merges the step-2 actor (verl's own merger) into a Hugging Face folder whose
weights equal, bf16 for bf16 (the merger writes bf16), those the actor last sent its servers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from verl_loop_support import REAL_WORKER_OVERRIDES, compose_config, method_block  # noqa: E402

pytestmark = [pytest.mark.verl_workers, pytest.mark.slow, pytest.mark.e2e]

WORLD = 2
CHILD_TIMEOUT = 600


def fit_in_child(config_path: Path, run_dir: Path, *extra: str) -> int:
    """Run :mod:`verl_fit_child` in a new process group; its return code (negative: killed by a signal)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(HERE / "verl_fit_child.py"), str(config_path), str(run_dir), str(WORLD),
                              *extra], start_new_session=True, env=env, stdout=subprocess.DEVNULL,
                             stderr=open(run_dir / f"child{len(extra)}.log", "w"))
    try:
        return child.wait(timeout=CHILD_TIMEOUT)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)


def test_a_killed_run_resumes_at_the_next_step_and_its_checkpoint_merges(workspace, tmp_path, kedro_project):
    from kedro.framework.session import KedroSession
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = compose_config(method_block("spader"), workspace, run_dir, steps=2, n_gpus_per_node=WORLD,
                            overrides=[*REAL_WORKER_OVERRIDES, "trainer.save_freq=1", "trainer.resume_mode=auto"],
                            validation={"every": 0, "before_train": False, "max_questions": None})
    config_path = run_dir / "config.yaml"
    OmegaConf.save(config, config_path)
    checkpoints = Path(config.trainer.default_local_dir)

    assert fit_in_child(config_path, run_dir, "--die-after-checkpoint", "1") == -signal.SIGKILL
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (checkpoints / "global_step_2").exists()
    killed = [json.loads((run_dir / f"server_{r}.json").read_text()) for r in range(WORLD)]
    (run_dir / "metrics.jsonl").rename(run_dir / "metrics_killed.jsonl")
    initial = killed[0]["weight_updates"][0]
    # the step-1 checkpoint is saved before the step's weights are synced: the servers hold the start's
    assert [u["global_steps"] for s in killed for u in s["weight_updates"]] == [0] * WORLD

    assert fit_in_child(config_path, run_dir) == 0
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2]
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = [json.loads((run_dir / f"server_{r}.json").read_text()) for r in range(WORLD)]
    for server in resumed:
        # the resumed actor starts from the step-1 checkpoint (trained weights, not the start's), then step 2
        assert [u["global_steps"] for u in server["weight_updates"]] == [1, 2]
        checksums = [initial["checksum"], *(u["checksum"] for u in server["weight_updates"])]
        assert len(set(checksums)) == 3, checksums
    assert resumed[0]["weight_updates"] == [{**u, "at": resumed[0]["weight_updates"][k]["at"]}
                                            for k, u in enumerate(resumed[1]["weight_updates"])]

    actor = checkpoints / "global_step_2" / "actor"
    assert json.loads((actor / "fsdp_config.json").read_text())["world_size"] == WORLD
    manifests = kedro_project / "data/06_models"
    (manifests / "train_spader").mkdir(parents=True)
    (manifests / "train_spader/policy_manifest.json").write_text(json.dumps(
        {"backend": "verl", "method": "spader", "checkpoint": str(actor.parent), "actor_dir": str(actor), "path": None}))
    (manifests / "train_grpo").mkdir(parents=True)  # the other default method: a native run, passed through
    (manifests / "train_grpo/policy_manifest.json").write_text(json.dumps(
        {"backend": "native", "method": "grpo", "path": str(workspace["model"])}))
    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["merge"])

    merged_dir = Path(json.loads((manifests / "train_spader/model_manifest.json").read_text())["path"])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16).state_dict()
    sent = torch.load(run_dir / "server_0.pt")
    assert set(merged) == set(sent)
    for name, tensor in sent.items():
        assert torch.equal(merged[name], tensor), name
