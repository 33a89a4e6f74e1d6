"""verl's platform for a machine without an accelerator: the CPU as verl's device, gloo as its backend.

verl reaches its device only through the platform (``verl.plugin.platform``): the device's name, its
torch module (``get_torch_device()``), its collective backend, its Ray resource. :class:`PlatformCPU`
answers each for the CPU, so verl's own workers (FSDP2 actor and reference, the checkpoint engine's
weight sync) run unchanged on a laptop; ``VERL_PLATFORM=cpu`` selects it (docs/training.md, "verl on
a CPU").

The Ray resource is ``GPU``: verl's resource pools ask for it by that name in places no platform method
reaches (``single_controller/ray/base.py``, ``ResourcePoolManager._check_resource_available``), so a CPU
run declares its worker slots as Ray GPUs (``ray.init(num_gpus=N)``: :func:`ray_init_kwargs`). With the
CPU build of torch, the ``CUDA_VISIBLE_DEVICES`` Ray sets for them is read by nothing.
"""

from __future__ import annotations

import contextlib
import os
import platform as host_platform
import resource
from types import SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

#: the name ``VERL_PLATFORM`` selects
PLATFORM_NAME = "cpu"


def _resident_bytes() -> int:
    """This process's resident set (what an accelerator would call its allocated memory)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _host_memory() -> tuple[int, int]:
    """``(free, total)`` bytes of the host, as ``torch.cuda.mem_get_info`` reports a device's."""
    page = os.sysconf("SC_PAGE_SIZE")
    free, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        free = int(fields["MemAvailable"].split()[0]) * 1024
    return free, total


def cpu_device_module() -> SimpleNamespace:
    """``torch.cpu`` plus what verl calls on an accelerator's module and ``torch.cpu`` lacks.

    Memory queries report the process's resident set and the host's memory; cache and IPC housekeeping
    are no-ops (the CPU allocator returns freed blocks itself); the RNG is torch's CPU generator."""
    names = {name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")}
    return SimpleNamespace(
        **names,
        empty_cache=lambda: None,
        ipc_collect=lambda: None,
        set_per_process_memory_fraction=lambda fraction, device=None: None,
        mem_get_info=lambda device=None: _host_memory(),
        memory_allocated=lambda device=None: _resident_bytes(),
        memory_reserved=lambda device=None: _resident_bytes(),
        max_memory_allocated=lambda device=None: _peak_resident_bytes(),
        max_memory_reserved=lambda device=None: _peak_resident_bytes(),
        reset_peak_memory_stats=lambda device=None: None,
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_device_name=lambda device=None: host_platform.processor() or host_platform.machine(),
    )


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """The host CPU as verl's device (selected by ``VERL_PLATFORM=cpu``, never auto-detected)."""

    _module = None

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        if PlatformCPU._module is None:
            PlatformCPU._module = cpu_device_module()
        return PlatformCPU._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # only by name: a machine with an accelerator keeps it

    def current_device(self) -> str:
        # verl builds devices as ``torch.device(get_device_id())`` and passes it as FSDP's device_id
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def ray_init_kwargs(slots: int, cpus: int | None = None) -> dict[str, Any]:
    """``ray.init`` arguments for a CPU run with ``slots`` worker slots (trainer ranks), declared as
    the Ray GPUs verl's resource pools ask for (:class:`PlatformCPU`, module docstring)."""
    kwargs: dict[str, Any] = {"num_gpus": int(slots)}
    if cpus is not None:
        kwargs["num_cpus"] = int(cpus)
    return kwargs
