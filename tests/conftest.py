"""Session-wide test settings: no telemetry, no hub access, a private MLflow store, and the precision
that ``bf16: auto`` resolves to (``--bf16``; docs/performance.md#precision-in-tests)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption("--bf16", choices=("on", "off", "auto"), default=None,
                     help="force what `bf16: auto` resolves to in this run and its child processes "
                          "(sets SPADER_BF16; default: the environment's SPADER_BF16, else the machine decides)")


def pytest_configure(config):
    forced = config.getoption("--bf16")
    if forced is not None:  # in the environment, so that trainer and Kedro child processes see it too
        os.environ["SPADER_BF16"] = forced
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # under pytest-xdist each worker takes its share of the cores, not all of them
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # child processes (Kedro stages, Ray actors) too
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(session, config, items):
    """The suite's longest module (``longest``: minutes of one worker) first, then modules that run a
    whole pipeline (``e2e``), then those with ``slow`` tests, then the rest, each group in collection
    order. Under ``--dist loadscope`` a worker takes the next module when it is free, so the long
    modules start at once and the short ones fill in behind them, instead of one long module starting
    last and running alone at the end."""
    def rank(module: str) -> int:
        marks = {mark.name for item in by_module[module] for mark in item.iter_markers()}
        return 0 if "longest" in marks else 1 if "e2e" in marks else 2 if "slow" in marks else 3

    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(by_module, key=rank)  # stable: collection order within a rank
    items[:] = [item for module in order for item in by_module[module]]


def pytest_report_header(config):
    from spader_pipeline.bf16_switch import FORCE_ENV, cpu_has_bf16, forced_bf16  # torch-free

    forced = forced_bf16()
    if forced is not None:
        return f"bf16 auto: {'on' if forced else 'off'} (forced by {FORCE_ENV})"
    verdict = {True: "on (it has a bf16 unit)", False: "off (no bf16 unit)", None: "a timing probe decides"}
    return f"bf16 auto on this CPU: {verdict[cpu_has_bf16()]}; --bf16=on|off or {FORCE_ENV} forces it"


@pytest.fixture(scope="session", autouse=True)
def _private_mlflow_store(tmp_path_factory):
    """Every test session tracks into its own SQLite store, never the project's mlruns/."""
    store = tmp_path_factory.mktemp("mlruns")
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{store}/mlflow.db"
    yield store
    if previous is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = previous


@pytest.fixture(scope="session")
def project_root() -> Path:
    return PROJECT_ROOT


@pytest.fixture
def kedro_project(tmp_path, monkeypatch) -> Path:
    """A throw-away copy of the project (pyproject + conf) as the working directory.

    Kedro runs in it read this repository's configuration and code but write every dataset
    under ``tmp_path/data``. Use with ``KedroSession.create(project_path=..., env="test")``.
    """
    from kedro.framework.startup import bootstrap_project

    shutil.copy(PROJECT_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(PROJECT_ROOT / "conf", tmp_path / "conf", ignore=shutil.ignore_patterns("local"))
    (tmp_path / "conf" / "local").mkdir()
    (tmp_path / "src").mkdir()  # Kedro requires the source dir inside the project
    (tmp_path / "src" / "spader_pipeline").symlink_to(PROJECT_ROOT / "src" / "spader_pipeline")
    monkeypatch.chdir(tmp_path)
    bootstrap_project(tmp_path)
    return tmp_path
