"""The places where the plugin reaches into verl beyond its public registries, each mended here once.

verl's plugin points (platforms, engines, rollout replicas, checkpoint engines, estimators, reward
managers, agent loops) cover nearly everything a new device or rollout engine needs. Where they do not,
the plugin changes one name in one verl module, and nothing else. Each :class:`Gap` names verl's file and
line, why it needs mending, and a fingerprint of the verl source it relies on: verl's pin is exact
(``pyproject.toml``), and ``tests/verl_plugin/test_verl_gaps.py`` fails as soon as that source changes, so
an upgrade re-checks every mend instead of silently keeping a stale one. docs/training.md ("verl on a
CPU") lists them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Gap:
    """One place verl's plugin points do not reach.

    ``where``: verl's file and line(s), in verl's own tree. ``relies_on``: ``"module:qualname"`` of each
    verl function whose source the mend depends on, with its fingerprint (:func:`source_fingerprint`).
    """

    name: str
    where: str
    why: str
    relies_on: dict[str, str]


def source_fingerprint(target: str) -> str:
    """sha256 (first 16 hex digits) of the source of ``"module:qualname"`` in the installed verl."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def changed_sources(gaps: tuple[Gap, ...] | None = None) -> dict[str, list[str]]:
    """Per gap, the verl functions whose source no longer has the recorded fingerprint."""
    changed = {}
    for gap in gaps or GAPS:
        stale = [t for t, fp in gap.relies_on.items() if source_fingerprint(t) != fp]
        if stale:
            changed[gap.name] = stale
    return changed


# ------------------------------------------------------------------------------------- rollout adapters

ROLLOUT_ADAPTER_TABLE = Gap(
    name="rollout adapter table",
    where="verl/workers/rollout/base.py:89 (_ROLLOUT_REGISTRY), read by get_rollout_class (base.py:96)",
    why="the table of in-worker rollout adapters (what a trainer worker calls to sync weights into its rollout "
        "engine) has no register function, unlike RolloutReplicaRegistry for the servers",
    relies_on={"verl.workers.rollout.base:get_rollout_class": "d0be5827f1214f04"},
)


def register_rollout_adapter(name: str, fqdn: str, mode: str = "async") -> None:
    """Make ``get_rollout_class(name, mode)`` import ``fqdn`` (``module.Class``), as it does verl's own."""
    from verl.workers.rollout import base

    base._ROLLOUT_REGISTRY[(name, mode)] = fqdn


# ------------------------------------------------------------------------------------- CPU process group

CPU_PROCESS_GROUP = Gap(
    name="process group backend on a CPU",
    where="verl/utils/distributed.py:89 (initialize_global_process_group_ray), called without a backend by "
          "verl/workers/engine_workers.py:89 (TrainingWorker.__init__)",
    why='the default backend string is "cpu:gloo,{device}:{backend}", which torch refuses when the device is '
        'the CPU ("Duplicate device type cpu"); on a CPU the mend passes "cpu:gloo"',
    relies_on={
        "verl.utils.distributed:initialize_global_process_group_ray": "761a94d1a2e058d3",
        "verl.workers.engine_workers:TrainingWorker.__init__": "70637d361e50c14b",
    },
)


def _cpu_backend_when_none(original: Callable) -> Callable:
    @functools.wraps(original)
    def initialize(timeout_second=None, backend=None):
        from verl.utils.device import get_device_name

        if backend is None and get_device_name() == "cpu":
            backend = "cpu:gloo"
        return original(timeout_second=timeout_second, backend=backend)

    initialize.__spader_mend__ = True
    return initialize


def mend_cpu_process_group() -> None:
    from verl.utils import distributed
    from verl.workers import engine_workers

    if getattr(distributed.initialize_global_process_group_ray, "__spader_mend__", False):
        return
    mended = _cpu_backend_when_none(distributed.initialize_global_process_group_ray)
    distributed.initialize_global_process_group_ray = mended
    engine_workers.initialize_global_process_group_ray = mended  # imported there by name


# ------------------------------------------------------------------------------------- FSDP2 offload

UNPINNED_OFFLOAD = Gap(
    name="FSDP2 offload policy pins memory",
    where="verl/workers/engine/fsdp/transformer_impl.py:459-462 (FSDPEngine._build_fsdp_module)",
    why="a forward-only FSDP2 module (the reference policy) gets CPUOffloadPolicy(pin_memory=True), and "
        "pinning host memory needs an accelerator; without one the mend builds the policy unpinned",
    relies_on={"verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_fsdp_module": "35b7b539858443e4"},
)


def mend_unpinned_offload() -> None:
    from verl.workers.engine.fsdp import transformer_impl

    policy = transformer_impl.CPUOffloadPolicy
    if policy is None or getattr(policy, "__spader_mend__", False):
        return

    @dataclasses.dataclass
    class HostOffloadPolicy(policy):
        """``CPUOffloadPolicy`` that pins host memory only where an accelerator is present."""

        __spader_mend__ = True

        def __post_init__(self) -> None:
            if self.pin_memory and not torch.cuda.is_available():
                self.pin_memory = False

    transformer_impl.CPUOffloadPolicy = HostOffloadPolicy


#: every gap, in the order docs/training.md lists them
GAPS = (ROLLOUT_ADAPTER_TABLE, CPU_PROCESS_GROUP, UNPINNED_OFFLOAD)
