"""bf16 autocast is decided per device: given settings pass through, ``auto`` reads a CPU's flags
(the probe only where there are none), so the verdict does not follow the machine's load; ``SPADER_BF16``
forces ``auto`` for a whole process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spader_pipeline.modeling import precision
from spader_pipeline.modeling.precision import FORCE_ENV, bf16_faster_on_cpu, cpu_has_bf16, resolve_bf16

CPUINFO = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 {extra}\n\nprocessor\t: 1\n"


@pytest.fixture(autouse=True)
def _machine_decides(monkeypatch):
    """These tests check the machine's own decision: a forced suite run (``--bf16``) must not hide it."""
    monkeypatch.delenv(FORCE_ENV, raising=False)


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


@pytest.mark.parametrize(("value", "expected"), [("on", True), ("ON", True), ("1", True), ("true", True),
                                                 ("off", False), ("0", False), (" False ", False)])
def test_the_environment_forces_auto_on_every_device_but_never_an_explicit_setting(monkeypatch, value, expected):
    monkeypatch.setenv(FORCE_ENV, value)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: not expected)  # the flags would say the opposite
    monkeypatch.setattr(precision, "bf16_faster_on_cpu", lambda *a: pytest.fail("no probe when forced"))
    assert resolve_bf16("auto", "cpu") is expected and resolve_bf16("auto", "cuda") is expected
    assert resolve_bf16(True, "cpu") is True and resolve_bf16(False, "cpu") is False


@pytest.mark.parametrize("value", ["auto", "", "  "])
def test_auto_or_empty_in_the_environment_leaves_the_decision_to_the_machine(monkeypatch, value):
    monkeypatch.setenv(FORCE_ENV, value)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert resolve_bf16("auto", "cpu") is True and resolve_bf16("auto", "cuda") is True
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert resolve_bf16("auto", "cpu") is False


def test_an_unknown_value_in_the_environment_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "yes please")
    with pytest.raises(ValueError, match=f"{FORCE_ENV}='yes please'.*on, off or auto"):
        resolve_bf16("auto", "cpu")
    assert resolve_bf16(False, "cpu") is False  # an explicit setting does not read it


@pytest.mark.slow
def test_the_pytest_option_forces_auto_for_the_session_and_its_child_processes(tmp_path):
    """``pytest --bf16=…`` (the opposite of this machine's own decision) sets the variable in the
    session's environment, which trainer and Kedro child processes inherit, and says so in the header."""
    forced = "off" if cpu_has_bf16() else "on"
    (tmp_path / "conftest.py").write_text((Path(__file__).parents[1] / "conftest.py").read_text())
    (tmp_path / "test_forced.py").write_text(
        "import os\n"
        "from spader_pipeline.modeling.precision import resolve_bf16\n"
        "def test_forced():\n"
        f"    assert os.environ['{FORCE_ENV}'] == '{forced}'\n"
        f"    assert resolve_bf16('auto', 'cpu') is {forced == 'on'}\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--bf16={forced}", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"bf16 auto: {forced} (forced by {FORCE_ENV})" in run.stdout


def _half_frozen_lm() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.model.layers[0].requires_grad_(False)  # the frozen bottom, as RL trains only the top blocks
    return model


def test_bf16_inference_casts_a_frozen_weight_once_per_block_and_gives_the_same_logits(monkeypatch):
    """Inside ``bf16_inference`` autocast keeps its bf16 copy of every weight, frozen ones too (a change
    to the fp32 weight inside the block is not seen: the cast was made once), the logits are the bits of
    plain no-grad autocast, no graph is built, and the frozen weights are frozen again after. (Autocast's
    own path: with packed weights the linear layers read their packed copies instead, which follow a
    change; tests/modeling/test_modeling_packed_linear.py.)"""
    from spader_pipeline.modeling import packed_linear
    from spader_pipeline.modeling.precision import bf16_inference

    monkeypatch.setattr(packed_linear, "PACK_WEIGHTS", False)

    model = _half_frozen_lm()
    ids = torch.tensor([[1, 5, 9, 3]])
    frozen = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(ids).logits
    with bf16_inference(model, "cpu", enabled=True):
        cached = model(ids).logits
        assert frozen.requires_grad and not cached.requires_grad
        frozen.mul_(2.0)  # the cast made by the first forward is reused: the same logits
        assert torch.equal(model(ids).logits, cached)
    frozen.div_(2.0)
    assert torch.equal(cached, plain)
    assert not frozen.requires_grad and model.model.layers[1].mlp.down_proj.weight.requires_grad
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        frozen.mul_(2.0)  # plain autocast casts a frozen weight at every forward: the change is seen
        assert not torch.equal(model(ids).logits, plain)
        frozen.div_(2.0)


def test_bf16_inference_restores_the_frozen_weights_after_an_error_and_is_plain_no_grad_when_off():
    from spader_pipeline.modeling.precision import bf16_inference

    model = _half_frozen_lm()
    with pytest.raises(RuntimeError, match="stop"), bf16_inference(model, "cpu", enabled=True):
        raise RuntimeError("stop")
    assert not any(p.requires_grad for p in model.model.layers[0].parameters())
    with bf16_inference(model, "cpu", enabled=False):
        logits = model(torch.tensor([[1, 2]])).logits
        assert logits.dtype == torch.float32 and not logits.requires_grad
    assert not any(p.requires_grad for p in model.model.layers[0].parameters())
