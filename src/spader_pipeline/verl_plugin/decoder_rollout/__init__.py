"""The project's decoder as a verl rollout engine (``actor_rollout_ref.rollout.name=spader_decoder``).

Registered on import: the replica through verl's ``RolloutReplicaRegistry``, the in-worker adapter in
verl's rollout-adapter table (:func:`spader_pipeline.verl_plugin.gaps.register_rollout_adapter`: that
table has no register function). Both load lazily: importing this package imports neither torch models
nor the server. See :mod:`.server` (batching, token budget, lifecycle) and :mod:`.replica`.
"""

from __future__ import annotations

from verl.workers.rollout.replica import RolloutReplicaRegistry

from spader_pipeline.verl_plugin.decoder_rollout.names import ROLLOUT_NAME, server_actor_name
from spader_pipeline.verl_plugin.gaps import register_rollout_adapter


def _replica_class():
    from spader_pipeline.verl_plugin.decoder_rollout.replica import DecoderReplica

    return DecoderReplica


RolloutReplicaRegistry.register(ROLLOUT_NAME, _replica_class)
register_rollout_adapter(ROLLOUT_NAME, "spader_pipeline.verl_plugin.decoder_rollout.replica.DecoderServerAdapter")

__all__ = ["ROLLOUT_NAME", "server_actor_name"]
