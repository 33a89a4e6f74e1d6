"""Register every method's advantage estimator in verl's registry (``register_adv_est``).

Each is the method's estimator from :mod:`spader_pipeline.algorithms.methods` (the same function
the native trainer calls), registered under the method's ``estimator`` name, for the methods
registered now and for any registered later (:func:`~spader_pipeline.algorithms.methods.on_register`).
A method whose estimator name is one of verl's own (``grpo``) runs verl's implementation, which must
equal the method's (``tests/algorithms/test_methods_cross_backend.py``).

verl 0.9's ``ray_trainer.compute_advantage`` calls a registered estimator with ``token_level_rewards``,
``response_mask``, ``config`` (the ``algorithm`` config) and ``index`` (= ``uid``) only, so every
per-step signal travels in ``token_level_rewards`` in the method's reward layout, as written by the
``spader`` reward manager (:mod:`.reward_manager`). The method's options are read from
:func:`verl_options_path` (``algorithm`` for verl's own estimators, whose options are verl's own
keys; ``algorithm.<estimator>`` for ours), the one place the reward manager reads them too; unknown
keys there are an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from verl.trainer.ppo.core_algos import AdvantageEstimator, register_adv_est

from spader_pipeline.algorithms.methods import (
    Method,
    get_method,
    method_advantages,
    on_register,
    options_from_mapping,
)

__all__ = ["uses_verl_estimator", "verl_options", "verl_options_path"]

#: estimator names verl implements itself
VERL_ESTIMATORS = frozenset(e.value for e in AdvantageEstimator)
_ESTIMATORS: dict[str, Callable] = {}


def uses_verl_estimator(method: str) -> bool:
    """``True`` when ``method`` names one of verl's own estimators (verl's implementation runs)."""
    return get_method(method).estimator in VERL_ESTIMATORS


def verl_options_path(method: str) -> str:
    """Where verl's config holds ``method``'s options: ``algorithm`` (verl's own keys) for verl's
    estimators, ``algorithm.<estimator>`` for ours."""
    estimator = get_method(method).estimator
    return "algorithm" if uses_verl_estimator(method) else f"algorithm.{estimator}"


def _get(config: Any, key: str) -> Any:
    if config is None:
        return None
    return config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)


def verl_options(method: str, algorithm: Any) -> Any:
    """The typed options of ``method`` from verl's ``algorithm`` config (defaults where unset)."""
    spec = get_method(method)
    path = verl_options_path(method)
    if path == "algorithm":
        names = [f.name for f in dataclasses.fields(spec.options)]
        block = {name: _get(algorithm, name) for name in names if _get(algorithm, name) is not None}
    else:
        block = _get(algorithm, path.removeprefix("algorithm.")) or {}
    return options_from_mapping(method, dict(block))


def _method_of(estimator: str) -> str:
    """The registered method that owns ``estimator`` (looked up at call time)."""
    from spader_pipeline.algorithms.methods import METHODS

    owners = [name for name, spec in METHODS.items() if spec.estimator == estimator]
    if len(owners) != 1:
        raise ValueError(f"estimator {estimator!r} belongs to {len(owners)} registered methods: {owners}")
    return owners[0]


def _estimator(name: str) -> Callable:
    """verl's estimator function for our estimator ``name`` (one function per name, so a method
    registered again, e.g. by a test, finds verl's registry entry already its own)."""
    if name in _ESTIMATORS:
        return _ESTIMATORS[name]

    def estimator(token_level_rewards, response_mask, config=None, index=None, **kwargs):
        if index is None:
            raise ValueError(f"the {name} estimator needs the batch's uid (index)")
        method = _method_of(name)
        options = verl_options(method, config)
        return method_advantages(method, token_level_rewards, response_mask, index, options)

    estimator.__name__ = estimator.__qualname__ = f"{name}_estimator"
    estimator.__doc__ = f":func:`spader_pipeline.algorithms.methods.method_advantages` of the method with estimator {name!r}."
    _ESTIMATORS[name] = estimator
    return estimator


def _register(method: Method) -> None:
    if method.estimator not in VERL_ESTIMATORS:
        register_adv_est(method.estimator)(_estimator(method.estimator))


on_register(_register)
