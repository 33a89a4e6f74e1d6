"""verl's two halves of a rollout engine for :class:`~.server.DecoderServer`.

* :class:`DecoderReplica` (verl's ``RolloutReplica``, registered under :data:`ROLLOUT_NAME`): starts one
  server per replica as a Ray actor on the node of the replica's first trainer worker, sharing its device;
  verl's ``LLMServerManager`` routes the agent loops' turns to it.
* :class:`DecoderServerAdapter` (verl's ``BaseRollout``, in each trainer worker): verl's checkpoint
  engine hands it the actor's weights after every update (``update_weights``, the ``naive`` backend of a
  hybrid engine: actor and rollout on the same device); it sends them to its replica's server in buckets
  of ``checkpoint_engine.update_weights_bucket_megabytes``. Every rank walks the weights (gathering an
  FSDP shard is collective); the replica's leader rank sends them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from spader_pipeline.verl_plugin.decoder_rollout.names import ROLLOUT_NAME, server_actor_name


def _rollout_world_size(config: Any) -> int:
    return int(config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size)


class DecoderReplica(RolloutReplica):
    """One :class:`~.server.DecoderServer` per replica (tensor, data and pipeline parallel size 1)."""

    async def launch_servers(self) -> None:
        from verl.utils.device import get_device_name, get_visible_devices_keyword

        from spader_pipeline.verl_plugin.decoder_rollout.server import DecoderServer

        if self.world_size != 1:
            raise ValueError(f"the {ROLLOUT_NAME} rollout serves one device per replica (tensor/data/pipeline "
                             f"parallel size 1), not {self.world_size}")
        device = get_device_name()
        keyword = get_visible_devices_keyword()
        node_id, visible = ray.get_runtime_context().get_node_id(), None
        if self.workers:
            node_id, visible = await self.workers[0].__ray_call__.remote(
                lambda worker: (ray.get_runtime_context().get_node_id(), os.environ.get(keyword)))
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server = ray.remote(DecoderServer).options(
            name=name, num_cpus=0, max_concurrency=self.max_concurrency,
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            # the server shares its trainer worker's GPU, which Ray does not assign to it
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}} if device == "cuda" else None,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank,
                 device=device, visible_devices=visible if device == "cuda" else None)
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name


async def _pairs(weights: Iterable | AsyncIterator) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for pair in weights:
            yield pair
    else:
        for pair in weights:
            yield pair
            await asyncio.sleep(0)


class DecoderServerAdapter(BaseRollout):
    """In a trainer worker: the replica's server, as verl's weight sync and memory calls reach it."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank, size = int(os.environ.get("RANK", 0)), _rollout_world_size(self.config)
        self.replica_rank = rank // size if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % size == 0
        self._server: Any = None

    def _handle(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank:
            await self._handle().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.is_leader_rank:
            await self._handle().sleep.remote()

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", global_steps: int | None = None,
                             peft_config: Any = None, **kwargs: Any) -> None:
        """Send every ``(name, tensor)`` of ``weights`` to the server, in buckets; then the server
        checks that all arrived, drops its KV caches and takes ``global_steps``."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the {ROLLOUT_NAME} rollout takes full weights, not {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError(f"the {ROLLOUT_NAME} rollout takes merged weights: set "
                                      "actor_rollout_ref.model.lora.merge=true with LoRA")
        limit = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        async for name, tensor in _pairs(weights):
            if not self.is_leader_rank:
                continue
            bucket.append((name, tensor.detach().to("cpu").contiguous()))
            size += bucket[-1][1].nbytes
            if size >= limit:
                await self._handle().load_weights.remote(bucket)
                bucket, size = [], 0
        if self.is_leader_rank:
            await self._handle().load_weights.remote(bucket, last=True, global_steps=global_steps)

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError(f"the {ROLLOUT_NAME} rollout serves verl's agent loops (async mode) only")


__all__ = ["ROLLOUT_NAME", "DecoderReplica", "DecoderServerAdapter"]
