"""The Makefile's test targets select the tests they promise (read from ``make -n``, evaluated with
pytest's own marker-expression parser)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parents[1]


def _marker_expression(target: str) -> str:
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    (line,) = [line for line in out.splitlines() if "-m pytest" in line]
    args = shlex.split(line)
    return args[args.index("-m", args.index("pytest")) + 1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("markers", [{"gpu"}, {"gpu", "slow"}, {"slow"}, {"e2e"}, {"heavy"}, {"verl_workers"}])
def test_make_test_fast_leaves_out_gpu_slow_e2e_heavy_and_verl_tests(markers):
    """``-m`` on the command line replaces pyproject's ``-m 'not gpu'``: the target must say it again."""
    expression = Expression.compile(_marker_expression("test-fast"))
    assert not expression.evaluate(lambda name: name in markers)
    assert expression.evaluate(lambda name: False)  # unmarked tests still run


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_every_cpu_test_runs_in_exactly_one_of_make_test_test_heavy_and_test_verl(pytestconfig):
    """The three tiers CI runs (.ci/run) split the CPU tests between them: none is run twice, none left
    out, whatever other markers it carries; GPU tests are in none. ``make test`` is a plain ``pytest``:
    its selection is the ``-m`` of the ini's addopts, as pytest read them."""
    import itertools

    addopts = pytestconfig.getini("addopts")
    tiers = {"test": Expression.compile(addopts[addopts.index("-m") + 1]),
             **{t: Expression.compile(_marker_expression(t)) for t in ("test-heavy", "test-verl")}}
    names = ("gpu", "heavy", "verl_workers", "slow", "e2e")
    for flags in itertools.product((False, True), repeat=len(names)):
        marks = {n for n, on in zip(names, flags, strict=True) if on}
        selected = [t for t, expression in tiers.items() if expression.evaluate(marks.__contains__)]
        assert len(selected) == (0 if "gpu" in marks else 1), (marks, selected)


def _kedro_runs(target: str) -> list[list[str]]:
    """The ``kedro run`` command lines ``make -n target`` prints (sub-makes included), as arguments."""
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    runs = [shlex.split(line) for line in out.splitlines() if "kedro run" in line]
    return [args[args.index("run") + 1:] for args in runs]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_is_the_default_chain_with_its_default_methods_side_by_side():
    """The part before the methods, one job per default method (the registry's), the part after:
    what ``around_methods`` splits the default chain into (tests/test_pipeline_registry.py)."""
    from spader_pipeline.algorithms.methods import default_methods

    runs = _kedro_runs("run")
    assert runs[0] == ["--pipeline", "default_before_methods"]
    assert runs[-1] == ["--pipeline", "default_after_methods"]
    assert sorted(runs[1:-1]) == sorted(["--nodes", f"train_{m}.train_policy"] for m in default_methods())
    assert all(["--env", "long"] == args[:2] for args in _kedro_runs("run-long"))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(("target", "env"), [("compare", "compare"), ("positive-control", "positive_control")])
def test_make_compare_and_positive_control_run_their_grid_on_ray(target, env):
    """One grid driver per target, on the pipeline and environment of its name; the driver reads the
    cells from the registered pipeline (every cell of ``positive_control``'s design is one job)."""
    from spader_pipeline.grid.phases import split
    from spader_pipeline.pipelines.positive_control import create_pipeline
    from spader_pipeline.pipelines.positive_control.nodes import cell_name
    from spader_pipeline.pipelines.positive_control.pipeline import CELLS

    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    (line,) = [shlex.split(line) for line in out.splitlines() if "spader_pipeline.grid" in line]
    assert line[line.index("-m"):] == ["-m", "spader_pipeline.grid", "--env", env, "--pipeline", env]
    assert "kedro run" not in out
    assert sorted(split(create_pipeline()).cells) == sorted(cell_name(m, s) for m, s in CELLS)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_positive_control_verl_runs_its_grid_in_the_positive_controls_environment():
    """The verl cells' grid runs in ``positive_control``'s environment (its data root, warm start and fitted
    set), so that after ``make positive-control`` only the verl cells and the report have work left."""
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", "positive-control-verl"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    (line,) = [shlex.split(line) for line in out.splitlines() if "spader_pipeline.grid" in line]
    assert line[line.index("-m"):] == ["-m", "spader_pipeline.grid", "--env", "positive_control",
                                       "--pipeline", "positive_control_verl"]


def _benchmark_scripts() -> list[str]:
    """Every script of benchmarks/: the ``bench_*.py`` and ``profile_*.py`` files (not their helpers
    ``smoke.py``, ``child_start_probe.py``)."""
    return sorted(f"benchmarks/{p.name}" for pattern in ("bench_*.py", "profile_*.py")
                  for p in (ROOT / "benchmarks").glob(pattern))


def _parses_smoke(path: Path) -> bool:
    """The script's ``__main__`` reaches ``smoke.parse_args`` (benchmarks/smoke.py adds ``--smoke``)."""
    import ast

    calls = [node for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Call)]
    return any(isinstance(c.func, ast.Attribute) and c.func.attr == "parse_args"
               and isinstance(c.func.value, ast.Name) and c.func.value.id == "smoke" for c in calls)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_bench_smoke_runs_every_benchmark_with_smoke():
    """``make bench-smoke`` (what CI runs after the tests) runs every benchmark script with ``--smoke``,
    and every one takes it: a new benchmark left out, or one that would fail on an unknown flag, fails here
    (read from the scripts and ``make -n``; nothing is run)."""
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", "bench-smoke"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    (loop,) = [line for line in out.splitlines() if line.lstrip().startswith("for b in ")]
    listed = shlex.split(loop.split(" in ", 1)[1].split(";", 1)[0])
    assert sorted(listed) == _benchmark_scripts()
    assert '$b --smoke ||' in out  # each with --smoke, stopping at the first failure
    assert [s for s in listed if not _parses_smoke(ROOT / s)] == []
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8").splitlines()
    (smoke,) = [i for i, line in enumerate(ci) if line.startswith("run_if_it_fits bench-smoke ")]
    assert smoke > ci.index("make test")


def _ci_with_fake_make(tmp_path: Path, limit_s: int, fail: str = "") -> subprocess.CompletedProcess:
    """``.ci/run`` with ``make`` replaced by a script that records its targets (and fails on ``fail``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "make"
    fake.write_text(f'#!/bin/sh\necho "$1" >> {tmp_path / "made"}\n[ "$1" != "{fail}" ]\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CI_LIMIT_S": str(limit_s), "CI_MARGIN_S": "60"}
    return subprocess.run(["bash", str(ROOT / ".ci/run")], env=env, capture_output=True, text=True)


def test_ci_runs_make_test_and_then_each_stage_that_fits_its_limit(tmp_path):
    """``.ci/run``: make test always; the later stages where they fit CI's limit, each skip said aloud."""
    done = _ci_with_fake_make(tmp_path, limit_s=3600)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "made").read_text().split() == ["test", "test-heavy", "bench-smoke", "gpu-resolve", "test-verl"]

    (tmp_path / "made").unlink()
    (tmp_path / "bin" / "make").unlink()
    (tmp_path / "bin").rmdir()
    tight = _ci_with_fake_make(tmp_path, limit_s=30)  # less than the margin: nothing after make test
    assert tight.returncode == 0, tight.stderr
    assert (tmp_path / "made").read_text().split() == ["test"]
    assert tight.stdout.count("skipped") == 4 and "make test-heavy skipped" in tight.stdout
    assert "make test-verl skipped" in tight.stdout


def test_ci_fails_when_make_test_fails(tmp_path):
    failed = _ci_with_fake_make(tmp_path, limit_s=3600, fail="test")
    assert failed.returncode != 0
    assert (tmp_path / "made").read_text().split() == ["test"]
