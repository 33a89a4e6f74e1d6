"""Each registered method's verl settings — the Hydra group ``spader_method`` — derived from the
method registry, so a method needs no hand-written overlay file.

For every method (now and whenever one registers, :func:`~spader_pipeline.algorithms.methods.on_register`)
a config ``spader_method/<method>`` goes into Hydra's ConfigStore: the estimator
(``algorithm.adv_estimator``), the options dataclass's defaults where verl's config holds them
(:func:`.estimators.verl_options_path`), and the reward manager's ``method`` and default tool cost
(plus the exploration weights for a method that pays SPADER's exploration reward). verl imports
this plugin before it composes its config, so ``conf/base/verl/method.yaml`` with
``spader_method=<method>`` (what the launcher passes) or any overlay naming the group finds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore

from spader_pipeline.algorithms.methods import Method, on_register
from spader_pipeline.algorithms.rewards import SpaderRewardConfig

from .estimators import verl_options_path

GROUP = "spader_method"
#: reward settings of the exploration reward, written out for the methods that pay it
EXPLORATION_KEYS = ("alpha", "beta", "lam")


def method_overlay(method: Method) -> dict[str, Any]:
    """The ``spader_method/<method>`` config (global package) of ``method``."""
    defaults = method.options()
    options = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
    algorithm: dict[str, Any] = {"adv_estimator": method.estimator}
    path = verl_options_path(method.name)
    if path == "algorithm":
        algorithm.update(options)
    else:
        algorithm[path.removeprefix("algorithm.")] = options
    reward: dict[str, Any] = {"method": method.name, "tool_round_cost": method.tool_round_cost}
    if method.exploration:
        config = SpaderRewardConfig()
        reward.update({key: getattr(config, key) for key in EXPLORATION_KEYS})
    return {"algorithm": algorithm, "reward": {"reward_kwargs": reward}}


def _store(method: Method) -> None:
    ConfigStore.instance().store(group=GROUP, name=method.name, node=method_overlay(method), package="_global_")


on_register(_store)
