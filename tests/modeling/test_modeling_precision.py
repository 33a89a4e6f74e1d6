"""bf16 autocast is decided per device: given settings pass through, ``auto`` probes a CPU once."""

from __future__ import annotations

import torch

from spader_pipeline.modeling.precision import bf16_faster_on_cpu, resolve_bf16


def test_explicit_settings_pass_through_and_cuda_is_always_on():
    assert resolve_bf16(True, "cpu") is True and resolve_bf16(False, "cuda") is False
    assert resolve_bf16("auto", "cuda") is True


def test_auto_on_cpu_is_the_probe_verdict_cached_per_width():
    model = torch.nn.Module()
    model.config = type("C", (), {"hidden_size": 32, "intermediate_size": 64})()
    bf16_faster_on_cpu.cache_clear()
    verdict = resolve_bf16("auto", "cpu", model)
    assert isinstance(verdict, bool)
    assert bf16_faster_on_cpu.cache_info().currsize == 1
    assert resolve_bf16("auto", torch.device("cpu"), model) is verdict
    assert bf16_faster_on_cpu.cache_info().hits == 1
