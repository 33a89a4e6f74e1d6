"""bf16 on the CPU: whether it has a native bf16 unit, and the environment switch that forces
``bf16: auto`` (:func:`spader_pipeline.modeling.precision.resolve_bf16` decides with both).

Torch-free, so that a process that only reports the decision (pytest's controller, which prints it in
its header and runs no test) need not import torch and transformers before its workers start.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# CPU flags of a native bf16 unit (Linux /proc/cpuinfo names).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# The environment variable that forces ``auto`` (:func:`forced_bf16`) and the values it accepts.
FORCE_ENV = "SPADER_BF16"
FORCE_VALUES = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False, "auto": None, "": None}


def forced_bf16() -> bool | None:
    """The ``auto`` decision forced by :data:`FORCE_ENV` (``on``/``off``, also ``1``/``0``,
    ``true``/``false``), or ``None`` where it is unset, empty or ``auto``. Read at every call, so a
    test can set it; any other value is an error rather than silently ignored."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if value not in FORCE_VALUES:
        raise ValueError(f"{FORCE_ENV}={os.environ[FORCE_ENV]!r}: expected on, off or auto")
    return FORCE_VALUES[value]


@functools.lru_cache(maxsize=1)
def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether the CPU has a native bf16 unit (:data:`BF16_FLAGS`); ``None`` where ``cpuinfo`` is
    missing or lists no ``flags`` (not Linux, or not x86): the probe decides there."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    found = bool(BF16_FLAGS.intersection(flags))
    logger.info("bf16 autocast %s: the CPU %s", "on" if found else "off",
                "has a bf16 unit" if found else "has no bf16 unit (avx512_bf16 / amx_bf16)")
    return found
