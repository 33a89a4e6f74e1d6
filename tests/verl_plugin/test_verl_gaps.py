"""The CPU platform and the mended gaps of :mod:`spader_pipeline.verl_plugin.gaps`, checked against the
installed verl: each test fails when verl's code at a mended place changes (an upgrade re-checks the mend)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spader_pipeline.verl_plugin import cpu  # noqa: E402  (registers the platform, engines and mends)
from spader_pipeline.verl_plugin.gaps import GAPS, changed_sources, source_fingerprint  # noqa: E402


def test_every_mend_relies_on_the_verl_source_it_was_written_for():
    """verl's pin is exact; a new verl that changes a mended function fails here, naming the gap."""
    assert changed_sources() == {}
    assert all(gap.where.startswith("verl/") and gap.relies_on for gap in GAPS)


def test_a_changed_source_is_reported():
    gap = GAPS[0]
    stale = type(gap)(gap.name, gap.where, gap.why, {target: "0" * 16 for target in gap.relies_on})
    assert changed_sources((stale,)) == {gap.name: list(gap.relies_on)}
    assert source_fingerprint(next(iter(gap.relies_on))) == next(iter(gap.relies_on.values()))


def test_torch_refuses_verls_default_backend_on_a_cpu_and_the_mend_passes_gloo():
    from torch.distributed.distributed_c10d import BackendConfig
    from verl.utils import distributed
    from verl.workers import engine_workers

    from spader_pipeline.verl_plugin.gaps import _cpu_backend_when_none

    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        BackendConfig("cpu:gloo,cpu:gloo")  # what verl's f-string gives with the CPU as device
    # the one mended function, also where engine_workers imported it by name
    assert engine_workers.initialize_global_process_group_ray is distributed.initialize_global_process_group_ray
    assert distributed.initialize_global_process_group_ray.__spader_mend__
    calls = []

    mended = _cpu_backend_when_none(lambda **kwargs: calls.append(kwargs))
    with cpu_platform():
        mended(timeout_second=None)
        mended(backend="cpu:gloo,cuda:nccl")
    assert calls == [{"timeout_second": None, "backend": "cpu:gloo"},
                     {"timeout_second": None, "backend": "cpu:gloo,cuda:nccl"}]


def test_the_reference_policys_offload_is_unpinned_without_an_accelerator():
    from verl.workers.engine.fsdp import transformer_impl

    policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)
    assert isinstance(policy, torch.distributed.fsdp.CPUOffloadPolicy)
    assert policy.pin_memory is torch.cuda.is_available()


def test_verl_finds_our_rollout_adapter_and_replica():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import spader_pipeline.verl_plugin  # noqa: F401  (registers the rollout)
    from spader_pipeline.verl_plugin.decoder_rollout.replica import DecoderReplica, DecoderServerAdapter

    assert get_rollout_class("spader_decoder") is DecoderServerAdapter
    assert get_rollout_replica_class("spader_decoder") is DecoderReplica


def test_the_cpu_platform_answers_for_the_device():
    from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
    from verl.workers.engine import EngineRegistry

    with cpu_platform():
        assert get_device_name() == "cpu" and get_nccl_backend() == "gloo"
        free, total = get_torch_device().mem_get_info()
        assert 0 < free <= total
        assert get_torch_device().memory_allocated() > 0
        for backend in ("fsdp", "fsdp2"):
            assert EngineRegistry.get_engine_cls("language_model", backend).__name__ == "FSDPEngineWithLMHead"


def test_the_device_module_has_every_function_verl_calls_on_it():
    """Every ``get_torch_device().<name>`` in verl's source exists on the CPU platform's module: a verl
    that starts calling another device function fails here, not in a worker at run time."""
    root = Path(verl.__file__).parent
    called = {m for path in root.rglob("*.py") for m in re.findall(r"get_torch_device\(\)\.(\w+)", path.read_text())}
    module = cpu.PlatformCPU().device_module
    assert called and not [name for name in sorted(called) if not hasattr(module, name)]


def cpu_platform():
    from verl_loop_support import cpu_platform_in_driver

    return cpu_platform_in_driver()
