"""Build a typed config dataclass from a (Kedro / YAML / Hydra) mapping, strictly.

Every settings block of the project is a dataclass; :func:`from_mapping` is the one way a mapping
becomes one. Unknown keys are an error that names the block and lists the known keys, so a typo
or a stale key in ``conf/`` fails the run instead of silently falling back to a default.
:func:`method_settings` is the one way a training method's block is laid over the shared blocks.
Standard library only, so the pure algorithms core can use it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["from_mapping", "merge_settings", "method_settings"]

T = TypeVar("T")


def from_mapping(
    cls: type[T],
    params: Mapping[str, Any] | None,
    *,
    where: str | None = None,
    exclude: Iterable[str] = (),
    **fixed: Any,
) -> T:
    """``cls(**params, **fixed)``, rejecting keys that are not fields of ``cls``.

    Args:
        cls: a dataclass type.
        params: the mapping (``None`` = empty); OmegaConf ``DictConfig`` works too.
        where: the block's name in error messages (default: the class name).
        exclude: field names that may not come from ``params`` (they are decided elsewhere,
            e.g. by ``fixed``).
        fixed: fields set by the caller, not by the mapping.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    values = dict(params or {})
    excluded = set(exclude) | set(fixed)
    known = {f.name for f in dataclasses.fields(cls) if f.init} - excluded
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {where or cls.__name__} settings {unknown}; known: {sorted(known)}")
    return cls(**values, **fixed)


def merge_settings(base: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """``base`` with ``override`` laid over it; nested mappings are merged key by key."""
    out = dict(base)
    for key, value in (override or {}).items():
        nested = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = merge_settings(out[key], value) if nested else value
    return out


def method_settings(
    training: Mapping[str, Any], method: Mapping[str, Any], shared: str | None = None
) -> dict[str, Any]:
    """The settings of one training method (``conf/base/parameters_training.yml``): the method's
    block (``train_<method>.method``) laid over ``training.reward``, the reward settings every method
    and both backends share, and, given ``shared``, over the shared block ``training[shared]``
    (e.g. ``native``)."""
    base = dict(training.get(shared) or {}) if shared else {}
    base["reward"] = training.get("reward") or {}
    return merge_settings(base, method)
