"""The MLflow UI (``mlflow ui``: the tracking server with its REST API) on a store, as a context:
what ``make mlflow-ui`` runs, and what the tests browse."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


@contextmanager
def running_ui(
    tracking_uri: str, artifact_root: str | Path, *, host: str = "127.0.0.1", port: int | None = None,
    startup_timeout: float = 180.0, workers: int = 1,
) -> Iterator[str]:
    """Run ``mlflow ui`` (the tracking server: UI + REST API) on the store; yield its base URL.

    What ``make mlflow-ui`` runs, on a free loopback port; the server's process group is always
    stopped on exit. MLflow's job execution (a runner and seven Huey consumers, for GenAI jobs such as
    judges) is off unless ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION`` says otherwise: the runs and metrics a
    training writes need none of it, and its eight processes would start with every server.
    """
    from spader_pipeline.local_servers import free_port, stop_process_group, wait_healthy

    port = port or free_port(host)
    argv = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri,
            "--default-artifact-root", str(Path(artifact_root).resolve()), "--host", host, "--port", str(port),
            "--workers", str(workers)]
    env = {**os.environ, JOB_EXECUTION: os.environ.get(JOB_EXECUTION, "false")}
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               env=env)
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, startup_timeout, process, name="mlflow ui", interval=0.5)
        yield url
    finally:
        stop_process_group(process)
