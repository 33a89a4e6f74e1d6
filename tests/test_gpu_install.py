"""The GPU install (docs/gpu.md) follows verl's tested stack, offline: the extras against the installed
verl's own metadata, the constraints files against each other, the docs against the resolution
check's steps, and the check's requirement walk on small reports."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shlex
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
# The CPU pins constraints-gpu.txt does not copy (its header says why; numpy it pins in its own section).
SET_BY_THE_GPU_STACK = {"torch", "transformers", "numpy", "fastapi"}


def _load_check():
    spec = importlib.util.spec_from_file_location("check_gpu_resolution", ROOT / "scripts" / "check_gpu_resolution.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check = _load_check()


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def _verl_extra(extra: str) -> dict[str, Requirement]:
    """verl's requirements under ``extra``, by name, as its installed metadata lists them."""
    found = {}
    for line in importlib.metadata.requires("verl") or ():
        requirement = Requirement(line)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}) \
                and not requirement.marker.evaluate({"extra": ""}):
            found[canonicalize_name(requirement.name)] = requirement
    return found


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _by_name(requirements: list[Requirement]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in requirements}


def _base_verl() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return _by_name([Requirement(r) for r in project["dependencies"]])["verl"]


def test_the_installed_verl_is_the_pinned_one():
    assert _base_verl().specifier.contains(importlib.metadata.version("verl"))


def test_vllm_extra_is_verls_vllm_stack():
    verl = _by_name(_extras()["vllm"])["verl"]
    assert verl.extras == {"vllm"}
    assert str(verl.specifier) == str(_base_verl().specifier)
    assert "vllm" in _verl_extra("vllm")  # verl still names its vllm stack under that extra


def test_sglang_extra_is_verls_sglang_stack_less_sglang():
    ours = _by_name(_extras()["sglang"])
    verl = _verl_extra("sglang")
    assert set(verl) - {"verl", "sglang"} <= set(ours)
    for name, requirement in verl.items():
        if name not in ("verl", "sglang") and str(requirement.specifier).startswith("=="):
            assert ours[name].specifier == requirement.specifier, name
    assert "sglang" not in ours  # installed first, on its own: its transformers pin is overridden
    (sglang_step,) = [a for step in check.STACKS["sglang"] for a in step if a.startswith("sglang==")]
    assert Requirement(sglang_step).specifier == verl["sglang"].specifier


@pytest.mark.parametrize("extra", ["vllm", "sglang"])
def test_each_gpu_extra_carries_faiss_gpu_at_the_cpu_faiss_version(extra):
    faiss_gpu = _by_name(_extras()[extra])["faiss-gpu"]
    assert str(faiss_gpu.specifier) == "==" + _pins(ROOT / "constraints.txt")["faiss-cpu"]


def test_laptop_transformers_is_verls_gpu_transformers():
    laptop = _pins(ROOT / "constraints.txt")["transformers"]
    for extra in ("vllm", "sglang"):
        assert str(_verl_extra(extra)["transformers"].specifier) == f"=={laptop}"
    assert str(_by_name(_extras()["sglang"])["transformers"].specifier) == f"=={laptop}"
    base = _by_name([Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())
                     ["project"]["dependencies"]])["transformers"]
    assert base.specifier.contains(laptop)


def test_gpu_constraints_keep_every_cpu_pin_the_gpu_stack_does_not_set():
    text = (ROOT / "constraints-gpu.txt").read_text()
    stack_section = text[text.index("\n# --- GPU stack\n"):text.index("\n# --- the rest: ")]
    own = {canonicalize_name(line.split("==")[0]) for line in stack_section.splitlines() if "==" in line}
    cpu, gpu = _pins(ROOT / "constraints.txt"), _pins(ROOT / "constraints-gpu.txt")
    assert not {"torch", "transformers", "fastapi"} & set(gpu)
    assert {n: v for n, v in cpu.items() if n not in SET_BY_THE_GPU_STACK | own} == \
        {n: v for n, v in gpu.items() if n not in own}
    assert cpu["torch"] == "2.13.0"  # the CPU wheel: never for a GPU node


def test_docs_give_the_commands_the_check_resolves():
    docs = (ROOT / "docs" / "gpu.md").read_text()
    for steps in check.STACKS.values():
        for args in steps:
            assert f".venv/bin/pip install {shlex.join(args).replace(chr(39), chr(34))}" in docs
    flash_attn = _verl_extra("flash-attn-cu130torch211")["flash-attn"]
    assert f"pip install --no-build-isolation flash-attn{flash_attn.specifier}" in docs
    assert f"faiss-gpu{_by_name(_extras()['vllm'])['faiss-gpu'].specifier}" in docs


def _item(name: str, version: str, requires: list[str], extras: list[str] | None = None) -> dict:
    item = {"metadata": {"name": name, "version": version, "requires_dist": requires}}
    if extras is not None:
        item["requested_extras"] = extras
    return item


def test_a_later_step_replaces_what_an_earlier_one_chose():
    first = {"install": [_item("engine", "1.0", ["lib==1.0"]), _item("lib", "1.0", [])]}
    second = {"install": [_item("Lib", "2.0", [])]}
    packages = check.overlay([first, second])
    assert packages["lib"]["metadata"]["version"] == "2.0"
    violations = check.unmet_requirements(packages, {})
    assert [(v.package, v.found) for v in violations] == [("engine", "2.0")]


def test_requirements_behind_extras_are_checked_once_an_extra_is_asked_for():
    packages = check.overlay([{"install": [
        _item("app", "1.0", ["stack[gpu]==2.0"], extras=[]),
        _item("stack", "2.0", ['kernel==3.0; extra == "gpu"', 'docs>=1; extra == "doc"']),
        _item("kernel", "2.9", []),
    ]}])
    violations = check.unmet_requirements(packages, {})
    assert [(v.package, v.requirement, v.found) for v in violations] == \
        [("stack", 'kernel==3.0; extra == "gpu"', "2.9")]


def test_pip_runs_without_this_machines_configuration():
    env = check.clean_pip_env({"PIP_FIND_LINKS": "/opt/wheels", "PIP_CONSTRAINT": "c.txt", "PATH": "/bin"})
    assert env["PIP_CONFIG_FILE"] == "/dev/null" or env["PIP_CONFIG_FILE"].lower() == "nul"
    assert "PIP_FIND_LINKS" not in env and "PIP_CONSTRAINT" not in env and env["PATH"] == "/bin"
