"""verl on a machine without an accelerator: verl's own workers, as verl's plugins for other hardware do.

Load it first, before verl resolves its platform (``workers/engine/fsdp/transformer_impl.py`` does on
import), and select it by name::

    VERL_USE_EXTERNAL_MODULES=spader_pipeline.verl_plugin.cpu,spader_pipeline.verl_plugin
    VERL_PLATFORM=cpu

(:func:`spader_pipeline.verl_plugin.cpu.environment` returns both). Importing this module

* registers :class:`~.platform.PlatformCPU` under ``cpu`` (``verl.plugin.platform.PlatformRegistry``);
* registers verl's FSDP engines (language model and value model, FSDP1 and FSDP2) for the CPU device
  (``verl.workers.engine.EngineRegistry``): verl registers them for ``cuda`` and ``npu`` only;
* mends the gaps no plugin point reaches (:mod:`spader_pipeline.verl_plugin.gaps`).

The rollout engine on a CPU is the project's decoder (``rollout.name=spader_decoder``,
:mod:`spader_pipeline.verl_plugin.decoder_rollout`), registered by the main plugin. FSDP on a CPU runs
``strategy=fsdp2`` (FSDP1 with ``sync_module_states`` refuses CPU parameters) and
``attn_implementation=sdpa`` (verl's default is flash-attention 2); docs/training.md, "verl on a CPU".
"""

from __future__ import annotations

import warnings

from spader_pipeline.verl_plugin.cpu.platform import PLATFORM_NAME, PlatformCPU, ray_init_kwargs
from spader_pipeline.verl_plugin.gaps import mend_cpu_process_group, mend_unpinned_offload

#: import path of this module (first in ``VERL_USE_EXTERNAL_MODULES``)
MODULE = __name__


def register_engines() -> None:
    """verl's FSDP engines for the CPU device (idempotent)."""
    with warnings.catch_warnings():  # verl names every optional engine it cannot import (megatron, ...)
        warnings.simplefilter("ignore", UserWarning)
        from verl.workers.engine import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if PLATFORM_NAME not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device=PLATFORM_NAME)(engine)


def environment() -> dict[str, str]:
    """What a process (and every Ray worker) needs in its environment to run verl on the CPU."""
    return {"VERL_PLATFORM": PLATFORM_NAME}


mend_cpu_process_group()
register_engines()  # imports transformer_impl, which resolves the platform: registered above
mend_unpinned_offload()

__all__ = ["MODULE", "PLATFORM_NAME", "PlatformCPU", "environment", "ray_init_kwargs", "register_engines"]
