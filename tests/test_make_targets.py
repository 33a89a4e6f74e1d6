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
@pytest.mark.parametrize("markers", [{"gpu"}, {"gpu", "slow"}, {"slow"}, {"e2e"}])
def test_make_test_fast_leaves_out_gpu_slow_and_e2e_tests(markers):
    """``-m`` on the command line replaces pyproject's ``-m 'not gpu'``: the target must say it again."""
    expression = Expression.compile(_marker_expression("test-fast"))
    assert not expression.evaluate(lambda name: name in markers)
    assert expression.evaluate(lambda name: False)  # unmarked tests still run
