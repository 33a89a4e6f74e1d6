"""An actor checkpoint written the way a verl node writes it, on the CPU.

``world_size`` processes (``torch.multiprocessing.spawn``, ``torch.distributed`` over gloo) each load
the same Hugging Face model, wrap it in FSDP (version 1, what verl's ``strategy: fsdp`` uses) with
verl's own wrap policy over a one-dimensional ``fsdp`` device mesh, and save it with verl's own
``FSDPCheckpointManager``: one ``model_world_size_W_rank_R.pt`` per rank holding that rank's shard of
every weight (DTensors, ``Shard(0)``), ``fsdp_config.json`` and ``huggingface/`` (config and
tokenizer). Only the device differs from a GPU node: FSDP is given ``device_id=cpu``, without
verl's ``sync_module_states`` (GPU only).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def save_sharded_actor(model_dir: str | Path, actor_dir: str | Path, *, world_size: int = 2, step: int = 2) -> Path:
    """Write ``actor_dir`` from ``world_size`` FSDP ranks of the model in ``model_dir``; return it."""
    from spader_pipeline.local_servers import free_port

    mp.spawn(_save_rank, args=(world_size, str(model_dir), str(actor_dir), free_port(), step), nprocs=world_size)
    return Path(actor_dir)


def _save_rank(rank: int, world_size: int, model_dir: str, actor_dir: str, port: int, step: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.fsdp_utils import get_fsdp_wrap_policy

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        fsdp = FullyShardedDataParallel(
            model,
            auto_wrap_policy=get_fsdp_wrap_policy(model, config=None),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",)),
            device_id=torch.device("cpu"),  # verl passes its GPU; every rank loads the same weights, so
            # verl's sync_module_states (a broadcast from rank 0, GPU only) changes nothing here
            use_orig_params=False,
        )
        manager = FSDPCheckpointManager(fsdp, optimizer=None, processing_class=AutoTokenizer.from_pretrained(model_dir),
                                        checkpoint_config={"save_contents": ["model"], "load_contents": ["model"]})
        manager.save_checkpoint(actor_dir, global_step=step)
    finally:
        dist.destroy_process_group()
