"""The search agent: text protocol (``protocol``), prompts (``prompts``) and the multi-turn rollout (``rollout``)."""
