"""A grid on a Ray of two nodes, a head and a second node started with ``ray start`` on 127.0.0.1
(``RAY_ADDRESS``, as a cluster is used): the test env's positive control, its shared part then its 4
cells as Ray tasks, half a CPU each. One cell's worker is SIGKILLed once the cell has stored its first
checkpoint; Ray runs the cell again and it resumes there, with nothing of the killed attempt left
running. Every cell finishes; the killed cell's history equals that cell run undisturbed (the grid run
again with its outputs moved aside: only that cell runs). MLflow folds each grid under one run that
holds the verdict; the killed attempt's run is ended ``KILLED``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from spader_pipeline import tracking

CELLS = ["fit_grpo_seed0", "fit_spader_seed0", "fit_grpo_seed1", "fit_spader_seed1"]
KILLED = "fit_grpo_seed0"
#: per-step keys that time or size the run, not what it learned
MEASURED = ("perf/", "mem/", "time/", "timing")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_node(address: str | None, temp: Path, workers: tuple[int, int]) -> subprocess.Popen:
    """``ray start --block``: a head (no ``address``) or a node joining it, one CPU and 4 GiB each."""
    ray = Path(sys.executable).with_name("ray")
    args = [str(ray), "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--memory={4 * 2**30}",
            "--object-store-memory=100000000", "--disable-usage-stats",
            f"--dashboard-agent-listen-port={_free_port()}", f"--min-worker-port={workers[0]}",
            f"--max-worker-port={workers[1]}"]
    if address is None:
        args += ["--head", f"--port={_free_port()}", "--include-dashboard=false", f"--temp-dir={temp}"]
    else:
        args += [f"--address={address}"]
    log = (temp / f"ray-start-{'head' if address is None else 'node'}.log").open("w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(processes: list[subprocess.Popen]) -> None:
    """Stop each ``ray start --block`` and the Ray processes it started (its own process group): a
    few seconds to end, then killed (the grids have ended: nothing is left to save)."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


#: connects once the head's raylet has registered (its GCS answers first: on a slow VM the raylet
#: follows tens of seconds later, and a driver that connects before is refused at once, "No node info
#: found matching attributes"), then waits for the second node
NODES = """
import sys, time, ray
deadline = time.monotonic() + 240
while True:
    try:
        ray.init(address=sys.argv[1], logging_level="ERROR")
        break
    except ConnectionError:
        if time.monotonic() > deadline:
            raise
        time.sleep(2)
for _ in range(600):
    if len([n for n in ray.nodes() if n["Alive"]]) == 2:
        break
    time.sleep(0.2)
print(len([n for n in ray.nodes() if n["Alive"]]))
"""


@pytest.fixture
def two_nodes(monkeypatch):
    """The address of a Ray of two nodes on this machine, stopped at the end. Without Ray's token
    authentication: the cluster listens on the loopback only, and its clients (this test's, the grid's
    driver) need no token from the home folder."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths are limited
    head = _ray_node(None, temp, (23000, 23999))
    started = [head]
    try:
        port = int(next(a for a in head.args if a.startswith("--port=")).split("=")[1])
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:  # the head's GCS answers
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert head.poll() is None and time.monotonic() < deadline, (temp / "ray-start-head.log").read_text()
            time.sleep(0.2)
        started.append(_ray_node(address, temp, (24000, 24999)))
        nodes = subprocess.run([sys.executable, "-c", NODES, address], capture_output=True, text=True, timeout=300)
        assert nodes.stdout.strip() == "2", nodes.stdout + nodes.stderr
        yield address
    finally:
        _stop(list(reversed(started)))
        shutil.rmtree(temp, ignore_errors=True)


def _grid(project: Path, address: str, log: Path) -> subprocess.Popen:
    """``python -m spader_pipeline.grid --env test --pipeline positive_control`` on the cluster."""
    env = {**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": str(project / "src")}
    return subprocess.Popen([sys.executable, "-m", "spader_pipeline.grid", "--env", "test", "--pipeline",
                             "positive_control"], cwd=project, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _finish(grid: subprocess.Popen, log: Path) -> str:
    grid.wait(1500)
    output = log.read_text()
    assert grid.returncode == 0, output[-8000:]
    return output


def _history(project: Path, cell: str) -> list[dict]:
    history = json.loads((project / f"data/07_model_output/{cell}/training_history.json").read_text())
    return [{k: v for k, v in step.items() if not k.startswith(MEASURED)} for step in history]


def _cell_job(cell: str) -> psutil.Process | None:
    """The running ``kedro run`` of ``cell``'s job (its launcher, :mod:`spader_pipeline.grid.child`)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "spader_pipeline.grid.child" in cmdline and cell in cmdline:
            return process
    return None


def _stored_checkpoint(checkpoints: Path) -> bool:
    """Whether a checkpoint is stored (``step_000001``; ``step_000001.tmp`` is one being written)."""
    return checkpoints.is_dir() and any(p.name[5:].isdigit() for p in checkpoints.glob("step_*"))


def _running(process: psutil.Process) -> bool:
    """Whether ``process`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _grid_runs(since: int) -> dict[str, list]:
    """Each grid run of this test (by id) with its children, from the tracking store."""
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string=f"attributes.start_time >= {since}")
    grids = {r.info.run_id: [] for r in runs if r.data.tags.get(tracking.GRID_TAG) == "true"}
    for run in runs:
        parent = run.data.tags.get("mlflow.parentRunId")
        if parent in grids:
            grids[parent].append(run)
    return grids


@pytest.mark.heavy
@pytest.mark.e2e
@pytest.mark.slow
def test_a_grid_on_two_ray_nodes_survives_a_killed_worker_and_equals_an_undisturbed_run(kedro_project, two_nodes,
                                                                                        tmp_path):
    conf = kedro_project / "conf/test"
    (conf / "parameters_grid.yml").write_text("grid:\n  cell: {num_cpus: 0.5, memory_gib: 1}\n")
    (conf / "parameters_positive_control.yml").write_text(
        "positive_control:\n  validation_questions: 2\n  greedy_beside: false\n")
    training = conf / "parameters_training.yml"  # more steps: a window to kill the cell in
    assert "    total_steps: 2\n" in training.read_text()
    training.write_text(training.read_text().replace("    total_steps: 2\n", "    total_steps: 3\n"))
    since = int(time.time() * 1000)
    data = kedro_project / "data"
    checkpoints = data / "06_models/positive_control/seed0/train_grpo/checkpoints"

    started = time.monotonic()
    log = tmp_path / "grid.log"
    grid = _grid(kedro_project, two_nodes, log)
    try:
        while not _stored_checkpoint(checkpoints):
            assert grid.poll() is None, log.read_text()[-8000:]
            time.sleep(0.05)
        job = _cell_job(KILLED)
        assert job is not None, f"{KILLED} stored a checkpoint and its job is gone: it finished before it was killed"
        worker = job.parent()
        assert worker.name().startswith("ray::") or "ray::" in " ".join(worker.cmdline()), worker.cmdline()
        attempt = [job, *job.children(recursive=True)]  # the kedro run, its fork server, its training child
        worker.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while alive := [p for p in attempt if _running(p)]:
            assert time.monotonic() < deadline, f"the killed attempt left {[p.pid for p in alive]} running"
            time.sleep(0.1)
    except BaseException:
        grid.kill()
        raise
    output = _finish(grid, log)
    disturbed_seconds = time.monotonic() - started
    for cell in CELLS:
        assert (data / f"07_model_output/{cell}/training_history.json").is_file()
    assert "runs of killed attempts: positive control grpo seed0" in output
    assert "resuming grpo from step" in output  # the retried attempt went on from the stored checkpoint
    report = (data / "08_reporting/positive_control_report.md").read_text()

    # MLflow: one grid run, the verdict on it, its jobs folded under it, the killed attempt ended KILLED
    (grid_id, children), = _grid_runs(since).items()
    parent = mlflow.get_run(grid_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name.startswith("positive_control grid · env test")
    assert "positive_control/cells_reached" in parent.data.metrics and "grid/seconds" in parent.data.metrics
    assert "positive_control/report.md" in [a.path for a in mlflow.MlflowClient().list_artifacts(grid_id,
                                                                                                  "positive_control")]
    jobs = sorted((r.data.tags[tracking.GRID_JOB_TAG], r.info.status) for r in children)
    assert jobs == sorted([("shared part", "FINISHED"), *((c, "FINISHED") for c in CELLS), (KILLED, "KILLED")])
    assert {r.info.run_name for r in children if r.data.tags[tracking.GRID_JOB_TAG] == KILLED} == {
        "positive control grpo seed0"}

    # the killed cell again, undisturbed: its outputs and checkpoints moved aside, the grid run again
    disturbed = _history(kedro_project, KILLED)
    aside = tmp_path / "aside"
    aside.mkdir()
    for k, path in enumerate((*(data / folder / KILLED for folder in ("06_models", "07_model_output", "08_reporting")),
                              checkpoints.parent)):
        shutil.move(path, aside / str(k))
    log = tmp_path / "again.log"
    again = _finish(_grid(kedro_project, two_nodes, log), log)
    assert "shared part stored already" in again and "fit_spader_seed1 stored already" in again
    assert _history(kedro_project, KILLED) == disturbed
    assert (data / "08_reporting/positive_control_report.md").read_text() == report
    grids = _grid_runs(since)
    (second,) = [children for run_id, children in grids.items() if run_id != grid_id]
    assert [r.data.tags[tracking.GRID_JOB_TAG] for r in second] == [KILLED]
    print(f"grid with a killed worker: {disturbed_seconds:.0f} s; the killed cell again: {again.splitlines()[-1]}")
