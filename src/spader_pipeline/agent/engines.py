"""Rollout engines by name: the one place a generator that decodes a model's turns is built.

The native trainer, its validation, the evaluator (``kind: hf``), the portable held-out evaluation and
the verl decoder server all build their generator with :func:`build_generator`, from the engine name in
their settings (``engine``, default ``hf``); the warm start's protocol check builds ``hf`` the same way.
A second engine registers a :class:`~spader_pipeline.agent.types.Generator` class under its own name
with :func:`register_engine`, as verl keeps one registry per extension point (its rollout servers are
loaded by name the same way): the class is imported only when it is first needed, so checking a name
costs no model library.

An engine class takes ``(model, tokenizer, sampling, **options)``; callers pass ``max_prompt_tokens``,
``micro_batch_size`` and ``bf16``, and an engine ignores what it has no use for. Two options ask for a
capability, and :func:`build_generator` refuses them where the engine lacks it:

* ``capture_states_from_layer=k``: the engine keeps each trajectory's states at decoder block ``k``
  (:class:`~spader_pipeline.agent.types.CapturesStates`; the native trainer's boundary states). The
  trainer asks :func:`captures_states` first and, where the engine captures none, runs the frozen
  blocks in its update itself;
* ``return_log_probs=True``: each turn carries its tokens' log-probabilities
  (:attr:`~spader_pipeline.agent.types.Generator.supports_log_probs`; the verl decoder server needs them).

Left unset (``None``, ``False``) they are not passed on, so an engine without the capability need not
take them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spader_pipeline.agent.types import CapturesStates, Generator, SamplingParams
from spader_pipeline.typed_config import SettingsError

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "build_generator",
    "captures_states",
    "check_engine",
    "engine_class",
    "register_engine",
    "unregister_engine",
]

#: engine name -> a function returning its Generator class (called when the engine is first built)
ENGINES: dict[str, Callable[[], type[Generator]]] = {}
DEFAULT_ENGINE = "hf"


def register_engine(name: str, loader: Callable[[], type[Generator]] | None = None) -> Any:
    """Register an engine under ``name`` (a duplicate name is an error).

    ``loader`` returns the engine's class, importing it then; without it, ``register_engine(name)``
    decorates the class itself (``@register_engine("mine") class Mine(Generator): ...``).
    """
    if name in ENGINES:
        raise ValueError(f"rollout engine {name!r} is already registered")
    if loader is not None:
        ENGINES[name] = loader
        return loader

    def decorate(cls: type[Generator]) -> type[Generator]:
        ENGINES[name] = lambda: cls
        return cls

    return decorate


def unregister_engine(name: str) -> None:
    """Remove the engine called ``name`` (a no-op if it is not registered)."""
    ENGINES.pop(name, None)


def check_engine(name: str) -> str:
    """``name`` when an engine is registered under it; else a settings error that lists the registered ones."""
    if name not in ENGINES:
        raise SettingsError(f"unknown rollout engine {name!r}; registered: {sorted(ENGINES)}")
    return name


def engine_class(name: str) -> type[Generator]:
    """The generator class of the engine called ``name`` (imported now if it was not yet)."""
    return ENGINES[check_engine(name)]()


def captures_states(name: str) -> bool:
    """Whether the engine called ``name`` can keep a decoder block's states (:class:`CapturesStates`)."""
    return issubclass(engine_class(name), CapturesStates)


def build_generator(engine: str | Any, model: Any, tokenizer: Any, sampling: SamplingParams | None = None,
                    **options: Any) -> Generator:
    """The generator of ``engine`` (a name, or settings with an ``engine`` field) over ``model``.

    ``options`` go to the engine's constructor; the two that ask for a capability (module docstring)
    are checked against it, and dropped when they ask for nothing.
    """
    name = engine if isinstance(engine, str) else engine.engine
    cls = engine_class(name)
    if options.get("capture_states_from_layer") is not None and not issubclass(cls, CapturesStates):
        raise SettingsError(f"rollout engine {name!r} captures no states (capture_states_from_layer)")
    if options.get("return_log_probs") and not cls.supports_log_probs:
        raise SettingsError(f"rollout engine {name!r} returns no log-probabilities (return_log_probs)")
    for option in ("capture_states_from_layer", "return_log_probs"):
        if option in options and (options[option] is None or options[option] is False):
            del options[option]
    return cls(model, tokenizer, sampling, **options)


def _hf_generator() -> type[Generator]:
    from spader_pipeline.agent.hf_backend import HFGenerator

    return HFGenerator


register_engine(DEFAULT_ENGINE, _hf_generator)
