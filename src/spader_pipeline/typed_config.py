"""Build a typed config dataclass from a (Kedro / YAML / Hydra) mapping, strictly.

Every settings block of the project is a dataclass; :func:`from_mapping` is the one way a mapping
becomes one. Unknown keys are an error that names the block and lists the known keys, so a typo
or a stale key in ``conf/`` fails the run instead of silently falling back to a default. Standard
library only, so the pure algorithms core can use it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["from_mapping"]

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
