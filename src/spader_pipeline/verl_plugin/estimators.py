"""Register the project's advantage estimators in verl's registry: ``spa``, ``calibadv``, ``tspo``.

Each is the method's estimator from :mod:`spader_pipeline.algorithms.methods` (the same function
the native trainer calls), registered under the method's ``estimator`` name; ``grpo`` stays verl's
own implementation (equal to ours, tested).

verl 0.9's ``ray_trainer.compute_advantage`` calls a registered estimator with ``token_level_rewards``,
``response_mask``, ``config`` (the ``algorithm`` config) and ``index`` (= ``uid``) only, so every
per-step signal travels in ``token_level_rewards`` in the method's reward layout, as written by the
``spader`` reward manager (:mod:`.reward_manager`). The method's options are read from
``algorithm.<estimator>`` (``Method.verl_options_key``), the one place the reward manager reads them
too; unknown keys there are an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from verl.trainer.ppo.core_algos import register_adv_est

from spader_pipeline.algorithms.methods import (
    get_method,
    method_advantages,
    method_names,
    options_from_mapping,
)

__all__ = ["verl_options"]


def _get(config: Any, key: str) -> Any:
    if config is None:
        return None
    return config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)


def verl_options(method: str, algorithm: Any) -> Any:
    """The typed options of ``method`` from verl's ``algorithm`` config (defaults where unset)."""
    spec = get_method(method)
    if spec.verl_options_key == "algorithm":  # options are verl's own top-level keys (grpo)
        names = [f.name for f in dataclasses.fields(spec.options)]
        block = {name: _get(algorithm, name) for name in names if _get(algorithm, name) is not None}
    else:
        block = _get(algorithm, spec.verl_options_key.removeprefix("algorithm.")) or {}
    return options_from_mapping(method, dict(block))


def _register(method: str) -> None:
    spec = get_method(method)

    def estimator(token_level_rewards, response_mask, config=None, index=None, **kwargs):
        if index is None:
            raise ValueError(f"the {spec.estimator} estimator needs the batch's uid (index)")
        options = verl_options(method, config)
        return method_advantages(method, token_level_rewards, response_mask, index, options)

    estimator.__name__ = estimator.__qualname__ = f"{spec.estimator}_estimator"
    estimator.__doc__ = f"{spec.paper}: :func:`spader_pipeline.algorithms.methods.method_advantages` for {method!r}."
    register_adv_est(spec.estimator)(estimator)


for _method in method_names():
    if get_method(_method).estimator != "grpo":  # verl's own grpo serves GRPO
        _register(_method)
