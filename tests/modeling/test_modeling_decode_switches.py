"""The environment switches of the CPU's decoding numerics (SPADER_DECODE_STEP, SPADER_KV_CACHE): every
process started with them decodes with the Python step or over fp32 keys, as the module switches the tests
and benchmarks set do, so a whole run (its Ray jobs, its training children) can be repeated under numerics
the tests accept; an unknown value stops the process with the choices named."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = ("from spader_pipeline.modeling import decode_attention, native_step; "
         "print(native_step.NATIVE_STEP, decode_attention.BF16_CACHE)")


def _switches(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("SPADER_DECODE_STEP", "SPADER_KV_CACHE")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)


def test_the_switches_pick_the_step_and_the_key_cache_of_a_process():
    assert _switches().stdout.split() == ["True", "True"]
    assert _switches(SPADER_DECODE_STEP="python", SPADER_KV_CACHE="FP32").stdout.split() == ["False", "False"]
    assert _switches(SPADER_DECODE_STEP="cpp", SPADER_KV_CACHE="").stdout.split() == ["True", "True"]


def test_an_unknown_value_names_the_choices():
    failed = _switches(SPADER_KV_CACHE="fp16")
    assert failed.returncode != 0
    assert "SPADER_KV_CACHE='fp16': use one of bf16, fp32" in failed.stderr
