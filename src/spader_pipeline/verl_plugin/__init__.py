"""The only package that imports verl: registers the project's algorithms into stock verl 0.9.

Importing it registers

* advantage estimators ``spa``, ``calibadv``, ``tspo`` (:mod:`.estimators`, ``register_adv_est``);
* the reward-loop reward manager ``spader`` (:mod:`.reward_manager`);

and provides :class:`.batch_reward.GroupRewardAgentLoopManager` and :func:`.overrides.build_overrides`.

Every Ray process registers too, through either ``VERL_USE_EXTERNAL_MODULES=spader_pipeline.verl_plugin``
or the ``verl.plugins`` entry point in ``pyproject.toml`` (verl imports both on ``import verl``).
"""

from . import estimators, reward_manager  # noqa: F401  (registration side effects)

# --- agent/eval area: the search tool and the agent loop register here (their owner adds the imports) ---
# isort: split
from . import agent_loop, search_tool  # noqa: F401  (registers the `spader_search` agent loop)
# ---------------------------------------------------------------------------------------------------------
