"""Build a typed config dataclass from a (Kedro / YAML / Hydra) mapping, strictly.

Every settings block of the project is a dataclass; :func:`from_mapping` is the one way a mapping
becomes one. Unknown keys are an error that names the block, each key's full path and the known
keys, so a typo or a stale key in ``conf/`` fails the run instead of silently falling back to a
default; with ``check_types`` a value of the wrong kind (a string where a count goes) fails too,
naming what the field takes. :func:`typed_block` puts a block's path in front of the errors its
dataclass raises for bad values. :func:`method_settings` is the one way a training method's block is
laid over the shared blocks. :func:`settings_layer` checks a block that is laid over others before
its dataclass is built (``training.native`` under a method's block): its keys and kinds now, its
values later. Standard library only, so the pure algorithms core can use it too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar, Union

__all__ = ["SettingsError", "SettingsLayer", "from_mapping", "merge_settings", "method_settings", "settings_layer",
           "type_problem", "typed_block"]

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


class SettingsLayer(Mapping[str, Any]):
    """The keys one block sets for a dataclass it does not build alone (read-only): laid over the
    dataclass's defaults and under another block (a method's) before the dataclass is built.
    :func:`settings_layer` makes one, checked."""

    def __init__(self, target: type, values: Mapping[str, Any], where: str) -> None:
        self.target, self.where = target, where
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        return dict(self) == dict(other) if isinstance(other, Mapping) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a mapping: equal by content, not hashable

    def __repr__(self) -> str:
        return f"SettingsLayer({self.where}: {self._values!r})"


def settings_layer(cls: type, params: Mapping[str, Any] | None, *, where: str, exclude: Iterable[str] = (),
                   nested: Mapping[str, type] | None = None) -> SettingsLayer:
    """``params`` as a :class:`SettingsLayer` of ``cls``, checked as :func:`from_mapping` checks a
    block (an unknown key names its full path and the known keys; a value of the wrong kind names
    what the field takes); ``nested``: fields whose mapping is itself a layer of the given dataclass
    (``{"rollout": RolloutConfig}``), checked the same way under ``<where>.<field>``."""
    values = dict(params or {})
    from_mapping(_fields_only(cls, exclude), values, where=where, check_types=True)
    for key, inner in (nested or {}).items():
        if isinstance(values.get(key), Mapping):
            values[key] = dict(settings_layer(inner, values[key], where=f"{where}.{key}"))
    return SettingsLayer(cls, values, where)


def _fields_only(cls: type, exclude: Iterable[str]) -> type:
    """A stand-in dataclass with ``cls``'s settable fields (less ``exclude``) and annotations, each
    defaulted, so that :func:`from_mapping` checks a partial block's keys and kinds without building
    ``cls`` (whose checks of values need the whole configuration)."""
    hints, skip = _type_hints(cls), set(exclude)
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in skip]
    return dataclasses.make_dataclass(f"{cls.__name__}Layer", [(n, hints.get(n, Any), None) for n in names])


def merge_settings(base: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """``base`` with ``override`` laid over it; nested mappings are merged key by key."""
    out = dict(base)
    for key, value in (override or {}).items():
        nested = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = merge_settings(out[key], value) if nested else value
    return out


def method_settings(
    blocks: Mapping[str, Any], method: Mapping[str, Any], shared: str | None = None
) -> dict[str, Any]:
    """The settings of one training method (``conf/base/parameters_training.yml``): the method's
    block (``train_<method>.method``) laid over ``blocks["reward"]``, the reward settings every method
    and both backends share, and, given ``shared``, over the shared block ``blocks[shared]``
    (e.g. ``native``)."""
    base = dict(blocks.get(shared) or {}) if shared else {}
    base["reward"] = blocks.get("reward") or {}
    return merge_settings(base, method)
