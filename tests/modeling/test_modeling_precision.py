"""bf16 autocast is decided per device: given settings pass through, ``auto`` reads a CPU's flags
(the probe only where there are none), so the verdict does not follow the machine's load."""

from __future__ import annotations

import torch

from spader_pipeline.modeling import precision
from spader_pipeline.modeling.precision import bf16_faster_on_cpu, cpu_has_bf16, resolve_bf16

CPUINFO = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 {extra}\n\nprocessor\t: 1\n"


def test_explicit_settings_pass_through_and_cuda_is_always_on():
    assert resolve_bf16(True, "cpu") is True and resolve_bf16(False, "cuda") is False
    assert resolve_bf16("auto", "cuda") is True


def test_the_cpu_flags_decide_and_no_flags_means_probe(tmp_path):
    for extra, expected in (("avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True), ("avx512f", False)):
        info = tmp_path / f"cpuinfo-{extra.replace(' ', '-')}"
        info.write_text(CPUINFO.format(extra=extra))
        assert cpu_has_bf16(info) is expected
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_has_bf16(tmp_path / "arm") is None and cpu_has_bf16(tmp_path / "missing") is None


def test_auto_on_cpu_follows_the_flags_and_probes_once_per_width_without_them(monkeypatch):
    model = torch.nn.Module()
    model.config = type("C", (), {"hidden_size": 32, "intermediate_size": 64})()
    bf16_faster_on_cpu.cache_clear()
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert resolve_bf16("auto", "cpu", model) is False and bf16_faster_on_cpu.cache_info().currsize == 0
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: None)
    verdict = resolve_bf16("auto", "cpu", model)
    assert isinstance(verdict, bool)
    assert bf16_faster_on_cpu.cache_info().currsize == 1
    assert resolve_bf16("auto", torch.device("cpu"), model) is verdict
    assert bf16_faster_on_cpu.cache_info().hits == 1
