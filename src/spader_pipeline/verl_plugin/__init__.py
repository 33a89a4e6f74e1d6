"""Our parts registered in stock verl 0.9 through its public registries (no fork).

The one package that extends verl. Other modules use verl as a library only: the native trainer
(``native/trainer.py``: verl's policy loss, KL and actor config) and ``agent/tokens.py`` (verl's
token-layout builder). The methods themselves are defined in :mod:`spader_pipeline.algorithms.methods`.

Importing it registers

* advantage estimators ``spa``, ``calibadv``, ``tspo`` — the methods' estimators
  (:mod:`.estimators`, ``register_adv_est``);
* the reward-loop reward manager ``spader`` (:mod:`.reward_manager`);
* every method's verl settings, the Hydra group ``spader_method`` (:mod:`.method_configs`);
* the rollout engine ``spader_decoder``: the project's decoder as verl's LLM server, on CPU or CUDA
  (:mod:`.decoder_rollout`);

and provides :class:`.batch_reward.GroupRewardAgentLoopManager` (whose start-up check is
:mod:`.registration`). Everything verl calls lives here; :mod:`spader_pipeline.launch` only builds and
starts runs.

On a machine without an accelerator, :mod:`.cpu` (loaded before this package) makes verl's own
workers run on the CPU.

Every Ray process registers too, through either ``VERL_USE_EXTERNAL_MODULES=spader_pipeline.verl_plugin``
or the ``verl.plugins`` entry point in ``pyproject.toml`` (verl imports both on ``import verl``).
"""

from . import decoder_rollout, estimators, method_configs, reward_manager  # noqa: F401  (registration side effects)

# --- agent/eval area: the search tool and the agent loop register here (their owner adds the imports) ---
# isort: split
from . import agent_loop, search_tool  # noqa: F401  (registers the `spader_search` agent loop)
# ---------------------------------------------------------------------------------------------------------
