"""Build a typed config dataclass from a (Kedro / YAML / Hydra) mapping, strictly.

Every settings block of the project is a dataclass; :func:`from_mapping` is the one way a mapping
becomes one. Unknown keys are an error that names the block, each key's full path and the known
keys, so a typo or a stale key in ``conf/`` fails the run instead of silently falling back to a
default; with ``check_types`` a value of the wrong kind (a string where a count goes) fails too,
naming what the field takes. :func:`typed_block` puts a block's path in front of the errors its
dataclass raises for bad values. :func:`method_settings` is the one way a training method's block is
laid over the shared blocks. Standard library only, so the pure algorithms core can use it too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, Union

__all__ = ["SettingsError", "from_mapping", "merge_settings", "method_settings", "type_problem", "typed_block"]

T = TypeVar("T")


class SettingsError(ValueError):
    """A settings block that cannot be used: an unknown key or a bad value, named by its full path."""


def from_mapping(
    cls: type[T],
    params: Mapping[str, Any] | None,
    *,
    where: str | None = None,
    exclude: Iterable[str] = (),
    check_types: bool = False,
    **fixed: Any,
) -> T:
    """``cls(**params, **fixed)``, rejecting keys that are not fields of ``cls``.

    Args:
        cls: a dataclass type.
        params: the mapping (``None`` = empty); OmegaConf ``DictConfig`` works too.
        where: the block's path in error messages (default: the class name).
        exclude: field names that may not come from ``params`` (they are decided elsewhere,
            e.g. by ``fixed``).
        check_types: reject a value whose kind does not fit its field's annotation (bool, int,
            float, str, ``None``, ``Literal`` and unions of them; other annotations are the class's
            own to check), naming the field's full path and what it takes.
        fixed: fields set by the caller, not by the mapping.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    values = dict(params or {})
    excluded = set(exclude) | set(fixed)
    known = {f.name for f in dataclasses.fields(cls) if f.init} - excluded
    unknown = sorted(set(values) - known)
    block = where or cls.__name__
    if unknown:
        paths = ", ".join(f"{block}.{key}" for key in unknown)
        raise SettingsError(f"unknown {block} settings {unknown} ({paths}); known: {sorted(known)}")
    if check_types:
        hints = _type_hints(cls)
        for key, value in values.items():
            problem = type_problem(hints[key], value) if key in hints else None
            if problem:
                raise SettingsError(f"{block}.{key}={value!r}: {problem}")
    return cls(**values, **fixed)


def typed_block(where: str, build: Callable[[], T]) -> T:
    """``build()``, its bad-value errors (``ValueError``, ``TypeError``) prefixed with the block's path
    ``where`` (a :class:`SettingsError`), unless they already name it."""
    try:
        return build()
    except (ValueError, TypeError) as err:
        if isinstance(err, SettingsError) and where in str(err):
            raise
        raise SettingsError(f"{where}: {err}") from err


def type_problem(annotation: Any, value: Any) -> str | None:
    """What a field annotated ``annotation`` takes, when ``value`` is not of that kind; ``None`` when
    it is, or when the annotation is not one :func:`from_mapping` checks (containers, dataclasses)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if any(type_problem(arg, value) is None for arg in args):
            return None
        return "expected " + " or ".join(_described(arg) for arg in args)
    if origin is Literal:
        return None if value in args else f"use one of {list(args)}"
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,), type(None): (type(None),)}
    if annotation not in kinds:
        return None
    fits = isinstance(value, kinds[annotation]) and not (annotation in (int, float) and isinstance(value, bool))
    return None if fits else f"expected {_described(annotation)}"


def _described(annotation: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    if typing.get_origin(annotation) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):  # a name only imported for type checkers: nothing to check
        return {}


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
