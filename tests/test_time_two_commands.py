"""scripts/time_two_commands.py: the parts that decide its figures (which processes count, what a phase is)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

spec = importlib.util.spec_from_file_location("time_two_commands", ROOT / "scripts" / "time_two_commands.py")
timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timing)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_process_counts_when_its_working_directory_is_in_the_clone(tmp_path):
    clone, elsewhere = tmp_path / "clone", tmp_path / "elsewhere"
    clone.mkdir()
    elsewhere.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"],
                              cwd=clone)
    try:
        for _ in range(200):  # until its 64 MB are touched
            if timing.clone_pss_kb(clone) > 60 << 10:
                break
            subprocess.run(["sleep", "0.05"])
        assert timing.clone_pss_kb(clone) > 60 << 10
        assert timing.clone_pss_kb(elsewhere) == 0
    finally:
        holder.kill()
        holder.wait()


def test_phases_are_the_commands_make_echoes_and_the_pytest_summary_is_kept(tmp_path):
    script = ("echo .venv/bin/kedro run --pipeline default_before_methods; echo node output; "
              "echo OMP_NUM_THREADS=1 .venv/bin/kedro run --nodes train_grpo.train_policy; "
              "echo '===== 728 passed, 1 skipped in 351.16s (0:05:51) ====='; exit 3")
    result = timing.timed(["sh", "-c", script], tmp_path, tmp_path / "log", sample=0.05)
    assert result["rc"] == 3
    assert [line for _, line in result["phases"]] == [
        ".venv/bin/kedro run --pipeline default_before_methods",
        "OMP_NUM_THREADS=1 .venv/bin/kedro run --nodes train_grpo.train_policy"]
    assert result["summary"] == "728 passed, 1 skipped"
    stamped = (tmp_path / "log").read_text().splitlines()
    assert len(stamped) == 4 and stamped[1].split(maxsplit=1)[1] == "node output"
    assert float(stamped[0].split()[0]) >= 0


def test_the_machine_row_names_the_cpu_and_its_bf16_units():
    info = timing.machine()
    assert info["cores"].isdigit() and "family" in info["cpu"] and info["memory"].endswith("GiB")


def test_the_speed_probe_times_python_and_a_bf16_matmul_with_the_given_interpreter():
    import sys

    probe = timing.speed_probe(sys.executable)  # the test's venv: it has torch
    assert probe.startswith("Python loop of 10M additions") and probe.endswith("GFLOP/s")
    assert timing.speed_probe("/nonexistent/python") == "?"
