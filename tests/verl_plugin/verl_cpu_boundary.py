"""What stands in for verl's GPU parts when its trainer loop runs on CPU — and nothing else.

Three boundaries are replaced, each at verl's own extension point:

* **the LLM server engine**: :class:`ScriptedReplica` is registered as the ``sglang`` rollout replica
  (``RolloutReplicaRegistry``); verl's ``LLMServerManager``, its global load balancer and its
  ``LLMServerClient`` stay real and route every turn to :class:`ScriptedLLMServer`, a Ray actor with
  the server's ``generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`` signature that
  obeys sglang's per-turn token budget and writes protocol text (search, answer, malformed turns);
* **the FSDP actor/ref worker group**: :class:`RecordingWorkerGroup` (plus a placement-free resource
  pool manager) is what ``RayPPOTrainer`` talks to; it records every ``TensorDict`` it is asked to
  compute log-probs on or update with, and answers with constant log-probs;
* **the checkpoint manager** (weight sync to the rollout engine): :class:`NoopCheckpointManager`,
  loaded by verl from ``actor_rollout_ref.rollout.checkpoint_manager_class``.

Beside verl's *real* workers, the scripted server is also a rollout engine of its own
(``rollout.name=scripted``, :class:`ScriptedServerAdapter`): a batch whose behaviour the test knows,
trained on by verl's FSDP actor (``test_verl_native_parity.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import ray
import torch
from tensordict import TensorDict
from verl.single_controller.ray.base import ResourcePoolManager
from verl.utils import tensordict_utils as tu
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from spader_pipeline.verl_plugin.gaps import register_rollout_adapter

# ----------------------------------------------------------------------------------- LLM server


@ray.remote(num_cpus=0)
class ScriptedLLMServer:
    """Token-in/token-out server that plays a search agent with a different plan per rollout.

    The k-th trajectory started for a question follows plan ``k % 4`` (so each group of 4 rollouts
    holds all four, whatever the request order): 0 searches and answers the top title, 1 searches
    and answers every title seen, 2 searches twice (a useless query first) and answers wrongly,
    3 writes a malformed turn, then a wrong answer. The plan is written in the first turn's
    ``<think>``, so later turns read it back from the context.
    """

    def __init__(self, model_path: str, prompt_length: int, response_length: int, max_model_len: int):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.prompt_length, self.response_length = prompt_length, response_length
        self.max_model_len = max_model_len
        self.started: dict[str, int] = {}
        self.calls = 0
        self.max_new_tokens: list[int] = []

    def _budget(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> int:
        # sglang (verl/workers/rollout/sglang_rollout/async_sglang_server.py): per-turn cap is the
        # remaining prompt+response budget, clamped to the model context.
        possible = self.max_model_len - len(prompt_ids) - 1
        if possible < 0:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the context {self.max_model_len}")
        wanted = sampling_params.get("max_new_tokens", sampling_params.get("max_tokens"))
        if wanted is None:
            wanted = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        return max(0, min(int(wanted), possible))

    def _turn(self, context: str) -> str:
        question = re.findall(r"Question: (.*)", context)
        question = question[-1].strip() if question else ""
        titles = list(dict.fromkeys(re.findall(r"Doc \d+ \(Title: ([^)]*)\)", context)))
        plan = re.search(r"<think>plan (\d)", context)
        if plan is None:  # first turn of a new trajectory
            k = self.started[question] = self.started.get(question, -1) + 1
            plan = k % 4
            first = {0: question, 1: question, 2: "zzz unrelated words"}.get(plan)
            if first is None:
                return f"<think>plan {plan}</think> I am not sure."  # neither a search nor an answer
            return f'<think>plan {plan}</think><tool_call>["{first}"]</tool_call>'
        plan, searched = int(plan.group(1)), context.count("<tool_response>")
        if plan == 2 and searched < 2:
            return f'<think>plan 2 again</think><tool_call>["{question}"]</tool_call>'
        if plan in (0, 1) and titles:
            picked = titles[:1] if plan == 0 else titles
            return "<think>answering</think><answer>" + json.dumps(picked) + "</answer>"
        return '<think>guessing</think><answer>["Atlantis"]</answer>'

    async def generate(
        self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None, **kwargs
    ) -> TokenOutput:
        self.calls += 1
        budget = self._budget(list(prompt_ids), dict(sampling_params))
        self.max_new_tokens.append(budget)
        text = self._turn(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finished = len(ids) <= budget
        ids = ids[:budget]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed" if finished else None)

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "max_new_tokens": list(self.max_new_tokens)}

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None


SERVER_NAME = "scripted_llm_server"


def start_scripted_server(model_path: str, prompt_length: int, response_length: int, max_model_len: int):
    """Start the one scripted server a test session shares (actor start-up is the slow part on CPU)."""
    return ScriptedLLMServer.options(name=SERVER_NAME, lifetime="detached").remote(
        model_path, prompt_length, response_length, max_model_len
    )


class ScriptedReplica(RolloutReplica):
    """Rollout replica served by the session's :class:`ScriptedLLMServer` (registered as ``sglang``)."""

    async def launch_servers(self) -> None:
        server = ray.get_actor(SERVER_NAME)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"scripted-llm-{self.replica_rank}"


# ----------------------------------------------------------------------------------- actor / ref


@dataclass(frozen=True)
class CpuPool:
    """A named pool of ``world_size`` ranks (no placement group behind it)."""

    name: str
    world_size: int


class CpuResourcePoolManager(ResourcePoolManager):
    """verl's resource pool manager without GPU placement groups (the worker group is not Ray)."""

    def create_resource_pool(self) -> None:
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = CpuPool(name, sum(process_on_nodes))

    def get_n_gpus(self) -> int:
        return sum(sum(nodes) for nodes in self.resource_pool_spec.values())


class RecordingWorkerGroup:
    """In-process stand-in for the FSDP actor/rollout/ref worker group; records what it receives."""

    #: every call, in order: (method name, a detached copy of the TensorDict it got)
    calls: list[tuple[str, TensorDict]] = []

    def __init__(self, resource_pool=None, ray_cls_with_init=None, **kwargs) -> None:
        self.world_size = 1
        self.workers: list[Any] = []
        self._dispatch_info: dict[str, list[int]] = {}

    def spawn(self, prefix_set) -> dict[str, RecordingWorkerGroup]:
        return {prefix: self for prefix in prefix_set}

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]

    def init_model(self) -> None:
        return None

    def _record(self, name: str, data: TensorDict) -> None:
        RecordingWorkerGroup.calls.append((name, data.clone()))

    @staticmethod
    def _log_probs(data: TensorDict) -> torch.Tensor:
        ids = data["input_ids"]
        return torch.nested.nested_tensor_from_jagged(torch.full_like(ids.values(), -1.0, dtype=torch.float32), offsets=ids.offsets())

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        self._record("compute_log_prob", data)
        log_probs = self._log_probs(data)
        out = tu.get_tensordict({"log_probs": log_probs, "entropy": log_probs.abs()})
        tu.assign_non_tensor(out, metrics={"mfu": 0.0})
        return out

    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        self._record("compute_ref_log_prob", data)
        return tu.get_tensordict({"log_probs": self._log_probs(data)})

    def update_actor(self, data: TensorDict) -> TensorDict:
        self._record("update_actor", data)
        out = tu.get_tensordict({"dummy": torch.zeros(1)})
        tu.assign_non_tensor(out, metrics={"mfu": 0.0, "pg_loss": [0.0], "grad_norm": [0.0]})
        return out

    def save_checkpoint(self, *args, **kwargs) -> None:
        return None

    def load_checkpoint(self, *args, **kwargs) -> None:
        return None


class NoopCheckpointManager:
    """Weight sync between trainer and rollout engine: nothing to sync on CPU."""

    def __init__(self, config=None, actor_wg=None, replicas=None) -> None:
        self.updates: list[int | None] = []

    def update_weights(self, global_steps: int | None = None) -> None:
        self.updates.append(global_steps)

    def sleep_replicas(self) -> None:
        return None

    def wake_up_replicas(self) -> None:
        return None


# ----------------------------------------------------------------------------------- scripted rollout beside verl's real workers

#: ``actor_rollout_ref.rollout.name`` of the scripted server beside verl's real actor (its behaviour is
#: known, so a batch's rewards and advantages differ; the weights it is sent are consumed and dropped)
SCRIPTED_ROLLOUT = "scripted"


class ScriptedServerAdapter(BaseRollout):
    """In a real trainer worker: walks the weights verl's checkpoint engine yields (gathering FSDP shards
    is collective) and keeps none of them; the scripted server does not read weights."""

    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        self.weight_updates = 0

    async def resume(self, tags) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs) -> None:
        for _ in weights:
            pass
        self.weight_updates += 1


RolloutReplicaRegistry.register(SCRIPTED_ROLLOUT, lambda: ScriptedReplica)
register_rollout_adapter(SCRIPTED_ROLLOUT, f"{__name__}.ScriptedServerAdapter")
