"""An ``AgentLoopManager`` that assembles rewards over the whole generated batch.

Stock verl 0.9 computes rule rewards per sample while rolling out (``run_single`` in the reward loop)
and writes each scalar on the sample's last token; it calls the manager's batch hook
``assemble_rm_scores`` only on its colocated-reward-model path. Group-level rewards (SPADER's
novelty weights, CalibAdv's silver documents) need the whole prompt group, and the tool-cost schedule
needs the real training step, which only the trainer's generation batch carries
(``meta_info["global_steps"]``).

Select this manager with ``actor_rollout_ref.rollout.agent.agent_loop_manager_class=
spader_pipeline.verl_plugin.batch_reward.GroupRewardAgentLoopManager`` (a verl config field, no fork).
After every ``generate_sequences`` it calls ``assemble_rm_scores`` of the configured reward manager
class on the full batch — with the input's ``uid`` and ``global_steps`` — and replaces ``rm_scores``.
Works with the legacy trainer (``trainer.use_v1=false``), whose generation batches flow through the
manager; verl's v1 trainer streams samples into TransferQueue instead.
"""

from __future__ import annotations

import numpy as np
from verl import DataProto
from verl.experimental.agent_loop import AgentLoopManager
from verl.trainer.ppo.reward import resolve_reward_manager_cls
from verl.utils.ray_utils import auto_await

__all__ = ["GroupRewardAgentLoopManager", "assemble_group_rewards"]


def assemble_group_rewards(reward_cls, prompts: DataProto, output: DataProto) -> DataProto:
    """Replace ``output.batch["rm_scores"]`` by ``reward_cls.assemble_rm_scores`` over the whole batch.

    ``prompts`` is the (repeated) generation input: it supplies ``uid`` and ``meta_info["global_steps"]``
    in the same row order as ``output``.
    """
    if "rm_scores" not in output.batch.keys():
        return output
    if len(prompts) != len(output):
        raise ValueError(f"prompts ({len(prompts)}) and outputs ({len(output)}) are not aligned")
    non_tensor = dict(output.non_tensor_batch)
    for key in ("uid", "reward_model", "data_source"):
        if key in prompts.non_tensor_batch and key not in non_tensor:
            non_tensor[key] = prompts.non_tensor_batch[key]
    if "uid" not in non_tensor:  # no group labels: each sample is its own group
        non_tensor["uid"] = np.arange(len(output)).astype(str).astype(object)
    meta = dict(output.meta_info)
    if "global_steps" in prompts.meta_info:
        meta["global_steps"] = prompts.meta_info["global_steps"]
    merged = DataProto(batch=output.batch, non_tensor_batch=non_tensor, meta_info=meta)
    scores = output.batch["rm_scores"].sum(dim=-1).tolist()
    output.batch["rm_scores"] = reward_cls.assemble_rm_scores(merged, scores)
    return output


class GroupRewardAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` plus a whole-batch reward assembly after each generation."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.reward_cls = resolve_reward_manager_cls(config)
        configure = getattr(self.reward_cls, "configure", None)
        if configure is not None:
            configure(config)

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        output = await super().generate_sequences(prompts)
        return assemble_group_rewards(self.reward_cls, prompts, output)
