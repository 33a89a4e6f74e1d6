"""Check that each GPU install in docs/gpu.md resolves, without a GPU and without installing anything.

Each stack's steps run as ``pip install --dry-run --ignore-installed --report`` against the package
index alone: pip's configuration files and find-links are ignored, so the answer is the one a clean
GPU node gets. The step reports are then laid over each other (a later step replaces what an earlier
one chose) and every requirement of every package in the result is checked, as ``pip check`` would
on the installed node; the only mismatch allowed is the one the install overrides on purpose
(sglang 0.5.12 pins transformers 5.6.0, which verl 0.9.1 excludes; verl's stack runs it on 5.9.0).
Exit status 1 when a step stops resolving or the result breaks a requirement.

Usage: python scripts/check_gpu_resolution.py [--stack vllm|sglang ...] [--reports DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
GPU_CONSTRAINTS = "constraints-gpu.txt"
CPU_CONSTRAINTS = "constraints.txt"

# The install steps of each stack, in order, exactly as docs/gpu.md gives them after `pip install`
# (tests/test_gpu_install.py keeps the two in step). flash-attn is a separate source build and is
# not resolved here.
STACKS: dict[str, list[list[str]]] = {
    "vllm": [["-c", GPU_CONSTRAINTS, "-e", ".[vllm,dev]"]],
    "sglang": [["-c", GPU_CONSTRAINTS, "sglang==0.5.12"], ["-c", GPU_CONSTRAINTS, "-e", ".[sglang,dev]"]],
}

# (package, requirement name) pairs whose pin the install overrides on purpose.
ALLOWED_OVERRIDES = {("sglang", "transformers")}

# What pip reads besides the command line on this kind of machine: a global configuration file
# (extra local indexes, a torch cap) and find-links. Ignored, so the check sees the index alone.
_IGNORED_PIP_ENV = ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL", "PIP_REQUIREMENT")


@dataclass(frozen=True)
class Violation:
    """One requirement the resolved set does not meet."""

    package: str
    requirement: str
    found: str | None

    def __str__(self) -> str:
        return f"{self.package} requires {self.requirement}, resolved {self.found or 'nothing'}"


def clean_pip_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment for pip: no configuration files, find-links or extra indexes."""
    env = {k: v for k, v in environ.items() if k not in _IGNORED_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def resolve(args: list[str], report: Path) -> float:
    """Run one dry-run step, writing pip's report; return its seconds. Raises on a failed resolution."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), *args]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=clean_pip_env(dict(os.environ)),
                          capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"pip install {' '.join(args)} did not resolve ({seconds:.0f} s):\n{tail}")
    return seconds


def overlay(reports: list[dict]) -> dict[str, dict]:
    """The packages a sequence of installs leaves, by canonical name: a later step replaces an earlier one."""
    result: dict[str, dict] = {}
    for report in reports:
        for item in report["install"]:
            result[canonicalize_name(item["metadata"]["name"])] = item
    return result


def unmet_requirements(packages: dict[str, dict], environment: dict[str, str]) -> list[Violation]:
    """Every requirement (with the extras asked for anywhere in the set) that the set does not meet."""
    extras: dict[str, set[str]] = {name: set(item.get("requested_extras") or ()) for name, item in packages.items()}
    violations: dict[tuple[str, str], Violation] = {}
    changed = True
    while changed:  # extras requested by one package switch on requirements of another
        changed = False
        for name, item in packages.items():
            for line in item["metadata"].get("requires_dist") or ():
                requirement = Requirement(line)
                if not _applies(requirement, extras[name], environment):
                    continue
                target = canonicalize_name(requirement.name)
                wanted = extras.setdefault(target, set())
                if not requirement.extras <= wanted:
                    wanted |= requirement.extras
                    changed = True
                found = packages.get(target)
                version = found["metadata"]["version"] if found else None
                if version is None or not requirement.specifier.contains(version, prereleases=True):
                    violations[(name, line)] = Violation(name, line, version)
    return list(violations.values())


def _applies(requirement: Requirement, extras: set[str], environment: dict[str, str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in {"", *extras})


def pinned(path: Path, name: str) -> str | None:
    """The version ``name`` is pinned to in a constraints file, if it is."""
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and canonicalize_name(line.split("==", 1)[0]) == canonicalize_name(name):
            return line.split("==", 1)[1].strip()
    return None


def check_stack(stack: str, reports_dir: Path) -> list[str]:
    """Resolve one stack's steps and check the result; return the problems found (empty when it holds)."""
    reports, problems = [], []
    for index, args in enumerate(STACKS[stack], start=1):
        report_path = reports_dir / f"{stack}-step{index}.json"
        try:
            seconds = resolve(args, report_path)
        except RuntimeError as error:
            return [str(error)]
        reports.append(json.loads(report_path.read_text()))
        print(f"[{stack}] step {index}: pip install {' '.join(args)}: resolved in {seconds:.0f} s")
    packages = overlay(reports)
    environment = {**default_environment(), **reports[-1]["environment"]}
    for violation in unmet_requirements(packages, environment):
        if (violation.package, canonicalize_name(Requirement(violation.requirement).name)) in ALLOWED_OVERRIDES:
            print(f"[{stack}] overridden on purpose: {violation}")
        else:
            problems.append(f"[{stack}] {violation}")
    laptop = pinned(ROOT / CPU_CONSTRAINTS, "transformers")
    gpu = packages.get("transformers", {}).get("metadata", {}).get("version")
    if gpu != laptop:
        problems.append(f"[{stack}] transformers {gpu} on the GPU stack, {laptop} in {CPU_CONSTRAINTS} (the laptop's)")
    keys = ("torch", "transformers", "verl", "vllm", "sglang", "ray", "faiss-gpu")
    print(f"[{stack}] " + ", ".join(f"{k} {packages[k]['metadata']['version']}" for k in keys if k in packages))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="append", choices=sorted(STACKS), help="default: every stack")
    parser.add_argument("--reports", type=Path, default=ROOT / "build" / "gpu-resolution",
                        help="where pip's --report files go (default: build/gpu-resolution)")
    options = parser.parse_args(argv)
    options.reports.mkdir(parents=True, exist_ok=True)
    problems = [p for stack in options.stack or sorted(STACKS) for p in check_stack(stack, options.reports)]
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
