#!/usr/bin/env python3
"""Time the README's two commands as issue 41 measures them: a fresh clone, its install timed apart.

    python3 scripts/time_two_commands.py                     # make install, make run, make test at HEAD
    python3 scripts/time_two_commands.py --targets test --commit 6ca901c

What it does, in a new folder (``--workdir``, default a temporary one, removed at the end unless
``--keep``): clones this repository, checks out ``--commit``, times ``make install``, then each target
alone. Every output line of a target is stamped with the wall time since its start (the log lands in
the folder), and every ``--sample`` seconds the proportional set size of all the clone's processes is
summed: the stages' children are forks of a fork server and Ray's workers children of Ray, so
``/usr/bin/time`` on ``make`` would see only part of them. A process belongs to the clone when its
working directory or its command line lies inside it.

It prints one Markdown table: the machine (CPU model, family and model number, the bf16 units, cores,
memory, load before), then per command the machine's speed right before it (:data:`SPEED_PROBE`, with
the clone's Python), the wall time, exit status and peak memory; for ``make run``
the start of each phase (the lines ``make`` echoes), for ``make test`` pytest's summary line. Run it
on an idle machine: with another process running, every time here grows severalfold
(docs/results.md). Uses only the standard library and the system's ``python3`` (the speed probe runs with
the clone's).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASE = re.compile(r"^(\S*kedro run\b|OMP_NUM_THREADS=\S+ \S*kedro run\b|\S*python -m pytest\b)")
PYTEST_SUMMARY = re.compile(r"=+ (\d+ (passed|failed).*) in [\d.]+s")


def machine() -> dict[str, str]:
    """CPU model, family/model, bf16 units, cores, memory and load (Linux /proc; '?' elsewhere)."""
    info: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
        first = text.split("\n\n")[0]
        fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        flags = set(fields.get("flags", "").split())
        units = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        info["cpu"] = (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, "
                       f"model {fields.get('model', '?')}; {', '.join(units) or 'no AVX2'})")
        mem_kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        info["memory"] = f"{mem_kb / 2**20:.0f} GiB"
        info["load before"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except (OSError, AttributeError):
        info.setdefault("cpu", "?")
    info["cores"] = str(os.cpu_count())
    return info


#: A few seconds of the two kinds of work the commands do, timed on one core: interpreted Python, and
#: a bf16 matrix product of a SmolLM2-sized layer (576 → 1536) through torch. The same machine's speed
#: varies by the hour (docs/results.md, make test); a figure next to it says which hour it was.
SPEED_PROBE = """
import time
t = time.perf_counter(); s = 0
for i in range(10_000_000):
    s += i
loop = time.perf_counter() - t
try:
    import torch
except ImportError:
    print(f"Python loop of 10M additions {loop:.2f} s")
else:
    torch.set_num_threads(1)
    a, b = torch.randn(512, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)
    a @ b
    # as many products as fit a second (at most 400): ~0.2 s with a bf16 unit, ~1 s a product without one
    t, done = time.perf_counter(), 0
    while done < 400 and (done == 0 or time.perf_counter() - t < 1.0):
        a @ b
        done += 1
    rate = done * 2 * 512 * 576 * 1536 / (time.perf_counter() - t) / 1e9
    print(f"Python loop of 10M additions {loop:.2f} s; bf16 matmul on one thread {rate:.0f} GFLOP/s")
"""


def speed_probe(python: Path | str) -> str:
    """:data:`SPEED_PROBE` run by ``python`` (the clone's venv: its torch), or '?' if it fails."""
    try:
        done = subprocess.run([str(python), "-c", SPEED_PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return done.stdout.strip() or "?"


def clone_pss_kb(clone: Path) -> int:
    """Summed proportional set size (kB) of the processes whose cwd or command line is in ``clone``."""
    prefix, total = str(clone), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().decode(errors="replace")
            if not (cwd.startswith(prefix) or prefix in cmdline):
                continue
            rollup = Path(f"/proc/{entry.name}/smaps_rollup").read_text()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        match = re.search(r"^Pss:\s+(\d+) kB", rollup, re.MULTILINE)
        total += int(match.group(1)) if match else 0
    return total


def timed(command: list[str], clone: Path, log: Path, sample: float) -> dict:
    """Run ``command`` in ``clone``; wall seconds, exit status, peak summed PSS, stamped phase lines."""
    peak, done = [0], threading.Event()

    def sampler() -> None:
        while not done.wait(sample):
            peak[0] = max(peak[0], clone_pss_kb(clone))

    thread = threading.Thread(target=sampler, daemon=True)
    phases, summary = [], ""
    started = time.monotonic()
    thread.start()
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        for line in proc.stdout:
            elapsed = time.monotonic() - started
            out.write(f"{elapsed:8.1f} {line}")
            out.flush()  # the log can be followed while the target runs
            if PHASE.match(line):
                phases.append((elapsed, line.strip()[:100]))
            if match := PYTEST_SUMMARY.search(line):
                summary = match.group(1)
        proc.wait()
    wall = time.monotonic() - started
    done.set()
    thread.join()
    return {"wall": wall, "rc": proc.returncode, "peak_gb": peak[0] / 2**20, "phases": phases, "summary": summary}


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="HEAD", help="what to check out in the clone (default HEAD)")
    parser.add_argument("--targets", nargs="+", default=["run", "test"], choices=["run", "test", "test-heavy", "run-verl", "test-verl"],
                        help="make targets to time after the install, in this order")
    parser.add_argument("--workdir", type=Path, help="where to clone (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the clone and the logs")
    parser.add_argument("--sample", type=float, default=2.0, help="seconds between memory samples")
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="two-commands-"))
    clone = (work / "clone").resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=clone, check=True)
    rows = [(f"machine: {k}", v) for k, v in machine().items()]
    rows.append(("commit", f"`{commit}`"))
    install = 0.0
    try:
        for target in ["install", *args.targets]:
            if target != "install":
                rows.append((f"speed before `make {target}`", speed_probe(clone / ".venv/bin/python")))
            result = timed(["make", target], clone, work / f"make_{target}.log", args.sample)
            if target == "install":
                install, with_install = result["wall"], ""
            else:
                with_install = f"; {clock(install + result['wall'])} with the install"
            rows.append((f"`make {target}`", f"**{clock(result['wall'])}** (exit {result['rc']}{with_install}), peak "
                                             f"{result['peak_gb']:.2f} GB summed PSS"))
            for elapsed, line in result["phases"]:
                rows.append((f"  from {clock(elapsed)}", f"`{line}`"))
            if result["summary"]:
                rows.append(("  pytest", result["summary"]))
            if result["rc"] != 0:
                print(f"make {target} failed: see {work / f'make_{target}.log'}", file=sys.stderr)
                args.keep = True
                break
    finally:
        print("| what | measured |\n|---|---|")
        for what, value in rows:
            print(f"| {what} | {value} |")
        if args.keep:
            print(f"\nclone and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all("(exit 0" in v for w, v in rows if w.startswith("`make")) else 1


if __name__ == "__main__":
    sys.exit(main())
