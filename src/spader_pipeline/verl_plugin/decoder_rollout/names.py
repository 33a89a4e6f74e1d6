"""Names shared by the decoder rollout's halves (no verl or torch import)."""

from __future__ import annotations

#: ``actor_rollout_ref.rollout.name`` that selects the project's decoder as verl's rollout engine
ROLLOUT_NAME = "spader_decoder"


def server_actor_name(replica_rank: int, suffix: str = "") -> str:
    """The Ray actor name of replica ``replica_rank``'s server (the adapter finds it by this name)."""
    return f"{ROLLOUT_NAME}_server_{replica_rank}{suffix}"
