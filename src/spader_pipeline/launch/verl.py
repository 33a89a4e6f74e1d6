"""Launch VERL training (``python -m verl.trainer.main_ppo``) from a Kedro node.

What the launch does, in order:

1. starts the retrieval service on the index (``spader-retrieval serve``) unless a URL is given
   (``training.verl.retrieval``, the project's one
   :class:`~spader_pipeline.retrieval.settings.RetrievalSettings`), and writes a run-specific copy of
   the search-tool config pointing at it. verl runs its agent-loop workers on every Ray node, so with
   ``nnodes > 1`` the URL they get must not be loopback: bind the started service with
   ``retrieval.bind_host`` (e.g. ``0.0.0.0``) and give the address the other nodes reach it at in
   ``retrieval.advertised_host``, or pass an external ``retrieval.url``;
2. writes the node's ``verl_train``/``verl_validation`` datasets to ``<run_dir>/data/`` (unless
   ``training.verl.train_files``/``val_files`` name files), so verl reads the catalog's data wherever
   ``data_root`` puts it;
3. composes the command with :func:`~spader_pipeline.launch.overrides.main_ppo_argv` (``conf/base/verl/method.yaml``
   with ``spader_method=<method>``, whose settings come from the method registry, plus the
   overrides generated from Kedro parameters);
4. sets the environment: ``VERL_USE_EXTERNAL_MODULES=spader_pipeline.verl_plugin`` (our estimators,
   reward manager and agent loop register in every Ray process), ``MLFLOW_TRACKING_URI`` and
   ``MLFLOW_RUN_ID`` of the Kedro run (VERL's MLflow tracker joins it), ``RAY_ADDRESS`` for an
   existing cluster. The same variables are forwarded to every Ray worker through
   ``ray_kwargs.ray_init.runtime_env.env_vars`` (workers of a pre-started cluster do not inherit
   the launching shell's environment);
5. streams VERL's output to the log and to ``<run_dir>/verl.log``; a non-zero exit raises
   :class:`VerlLaunchError` carrying the last lines, so the node (and the Kedro run) fails with them.

Only :func:`launch_verl_training` needs a GPU; :func:`build_launch` is pure and tested on CPU.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import yaml

from spader_pipeline.launch.overrides import hydra_value, main_ppo_argv
from spader_pipeline.retrieval.settings import RetrievalSettings, retrieval_settings, service_url
from spader_pipeline.tracking.buffer import active_run_target, active_run_writer
from spader_pipeline.tracking.metrics_files import METRICS_PATH_ENV, follow_jsonl
from spader_pipeline.typed_config import from_mapping, method_settings

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

PLUGIN_MODULE = "spader_pipeline.verl_plugin"
DEFAULT_CONFIG_DIR = Path("conf/base/verl")

#: Hugging Face ``model_type`` → the paper schedule group ``conf/base/verl/spader_model/<name>.yaml``
MODEL_FAMILIES = {"qwen3": "qwen3_8b", "qwen2": "qwen3_8b", "llama": "llama3_8b"}
#: the parquet files of a launch (``training.verl`` settings and ``build_overrides`` keys)
DATA_KEYS = ("train_files", "val_files")
#: environment variables of the launch that every Ray worker needs too
FORWARDED_ENV = ("VERL_USE_EXTERNAL_MODULES", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "HF_HUB_OFFLINE",
                 "TOKENIZERS_PARALLELISM", "VERL_FILE_LOGGER_PATH", METRICS_PATH_ENV)


class VerlLaunchError(RuntimeError):
    """VERL exited with an error; the message ends with the tail of its log."""


@dataclass(frozen=True)
class VerlSettings:
    """``training.verl``: cluster, data files, config and retrieval service of a VERL launch."""

    model: str | None = None
    """``spader_model`` schedule group (``qwen3_8b``, ``llama3_8b``); ``None``: from the checkpoint's model_type"""
    overrides: Sequence[str] = ()
    """extra Hydra overrides, appended last"""
    ray_address: str | None = None
    """an existing Ray cluster (``ray://host:10001`` or ``host:6379``); ``None`` starts a local one"""
    n_gpus_per_node: int = 8
    nnodes: int = 1
    project_name: str | None = None
    total_training_steps: int | None = None
    logger: Sequence[str] = ("console", "mlflow")
    """verl's trackers"""
    train_files: str | None = None
    """a parquet file verl trains on; ``None``: the node's ``verl_train`` dataset (the catalog's, so
    under ``data_root``), written to ``<run_dir>/data/train.parquet``"""
    val_files: str | None = None
    """the validation parquet; ``None``: the node's ``verl_validation`` dataset, as for ``train_files``"""
    config_dir: str = str(DEFAULT_CONFIG_DIR)
    """folder of the Hydra configs (``method.yaml``), ``agent_loops.yaml`` and ``tool_config/``"""
    timeout: float | None = None
    """seconds before the launch is stopped; ``None``: no limit"""
    log_tail_lines: int = 80
    """lines of VERL's log kept for the error message when it fails"""
    retrieval: RetrievalSettings = field(default_factory=RetrievalSettings)
    """the search tool's retrieval service (``mode: local`` is refused: the agent loop searches over HTTP)"""


@dataclass
class Launch:
    """A composed VERL command: argv, extra environment and where its log goes."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    run_dir: Path
    extra: dict[str, Any] = field(default_factory=dict)


def verl_parameters(
    init_manifest: Mapping[str, Any],
    method: Mapping[str, Any],
    training: Mapping[str, Any],
    run_dir: str | Path,
    *,
    tool_config_path: str | Path | None = None,
    data_files: Mapping[str, str | Path] | None = None,
) -> dict[str, Any]:
    """The parameter dict of :func:`~spader_pipeline.launch.overrides.build_overrides` for one method.

    ``method`` is a ``train_<method>.method`` block; ``training.verl`` adds cluster settings and
    ``training.reward`` the shared reward settings (the same ones the native trainer uses).
    ``data_files`` (``train_files``, ``val_files``; :func:`data_files`) default to
    ``training.verl.train_files``/``val_files``, which must then be set.
    """
    verl = verl_settings(training)
    files = dict(data_files or {})
    for key in DATA_KEYS:
        files.setdefault(key, getattr(verl, key))
        if not files[key]:
            raise ValueError(f"no {key} for verl: set training.verl.{key} or pass the node's dataset")
    params: dict[str, Any] = {
        "method": method["method"],
        "model_path": str(Path(init_manifest["path"]).resolve()),
        "train_files": str(Path(files["train_files"]).resolve()),
        "val_files": str(Path(files["val_files"]).resolve()),
        "n_gpus_per_node": int(verl.n_gpus_per_node),
        "nnodes": int(verl.nnodes),
        "run_dir": str(Path(run_dir).resolve()),
        "experiment_name": f"train_{method['method']}",
        "logger": list(verl.logger),
        "reward": method_settings(training, method)["reward"],
        "options": dict(method.get("options") or {}),
        "validation": training.get("validation"),
        "overrides": list(verl.overrides or []),
        "model": verl.model or model_family(init_manifest["path"]),
    }
    for key in ("project_name", "total_training_steps"):
        if getattr(verl, key) is not None:
            params[key] = getattr(verl, key)
    if tool_config_path is not None:
        params["tool_config_path"] = str(Path(tool_config_path).resolve())
    params["agent_loop_config_path"] = str((Path(verl.config_dir) / "agent_loops.yaml").resolve())
    return params


def data_files(
    verl: VerlSettings, run_dir: str | Path, train: pd.DataFrame | None = None, validation: pd.DataFrame | None = None
) -> dict[str, str]:
    """The parquet files verl reads, as ``{"train_files", "val_files"}``.

    A configured ``training.verl.train_files``/``val_files`` must exist; otherwise the node's dataset
    (``verl_train``/``verl_validation``, from the catalog, so wherever ``data_root`` puts it) is
    written to ``<run_dir>/data/<split>.parquet``, which every node of the cluster reads like the
    checkpoints. Neither: an error naming the setting.
    """
    out: dict[str, str] = {}
    for key, frame, split in (("train_files", train, "train"), ("val_files", validation, "validation")):
        configured = getattr(verl, key)
        if configured:
            path = Path(configured)
            if not path.is_file():
                raise FileNotFoundError(f"training.verl.{key}={configured} does not exist (null: the catalog's "
                                        f"verl_{split} dataset, written by data_prep)")
        elif frame is not None:
            path = Path(run_dir) / "data" / f"{split}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            frame.to_parquet(path, index=False)
        else:
            raise ValueError(f"training.verl.{key} is null and no verl_{split} dataset was given to the launch")
        out[key] = str(path.resolve())
    return out


def verl_settings(training: Mapping[str, Any]) -> VerlSettings:
    """``training.verl`` as :class:`VerlSettings`; unknown keys raise (a misspelt or dead key never
    passes silently)."""
    block = training.get("verl")
    if isinstance(block, VerlSettings):
        return block
    values = dict(block or {})
    values["retrieval"] = retrieval_settings(values.get("retrieval"), where="training.verl.retrieval")
    return from_mapping(VerlSettings, values, where="training.verl")


def model_family(model_path: str | Path) -> str:
    """The ``spader_model`` schedule group of a checkpoint, from its ``config.json`` ``model_type``.

    Set ``training.verl.model`` to choose explicitly (e.g. for a family not in :data:`MODEL_FAMILIES`).
    """
    config = Path(model_path) / "config.json"
    if not config.is_file():
        raise ValueError(f"cannot tell the model family of {model_path} (no config.json); set training.verl.model")
    model_type = str(json.loads(config.read_text()).get("model_type", ""))
    if model_type not in MODEL_FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} of {model_path} has no paper schedule ({sorted(MODEL_FAMILIES)}); "
            "set training.verl.model to one of qwen3_8b, llama3_8b"
        )
    return MODEL_FAMILIES[model_type]


def is_loopback_url(url: str) -> bool:
    """True for a URL whose host only the local machine can reach (127.x, localhost, ::1, 0.0.0.0)."""
    host = (urlsplit(url).hostname or "").lower()
    return host.startswith("127.") or host in ("localhost", "::1", "0.0.0.0", "::", "")


def check_worker_url(url: str, nnodes: int) -> str:
    """``url`` if the agent-loop workers of every node can use it; raise for loopback with ``nnodes > 1``."""
    if nnodes > 1 and is_loopback_url(url):
        raise ValueError(
            f"the retrieval service URL {url} is loopback, but verl runs agent-loop workers on all {nnodes} "
            "nodes and their searches would fail. Set training.verl.retrieval.bind_host (e.g. 0.0.0.0) and "
            "retrieval.advertised_host (this node's address), or retrieval.url (a service every node reaches)"
        )
    return url


def ray_env_overrides(env: Mapping[str, str]) -> list[str]:
    """Hydra overrides forwarding :data:`FORWARDED_ENV` of ``env`` to every Ray worker."""
    return [f"++ray_kwargs.ray_init.runtime_env.env_vars.{key}={hydra_value(env[key])}"
            for key in FORWARDED_ENV if env.get(key)]


def verl_environment(
    *, tracking_uri: str | None, run_id: str | None, ray_address: str | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment of the VERL process (``base`` defaults to this process's environment)."""
    env = dict(os.environ if base is None else base)
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if PLUGIN_MODULE not in modules:
        modules.append(PLUGIN_MODULE)
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join(modules)
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    if run_id:
        env["MLFLOW_RUN_ID"] = run_id
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def write_tool_config(template: str | Path, url: str, out: str | Path, settings: RetrievalSettings | None = None) -> Path:
    """Copy the search-tool config with ``retrieval_service_url`` set to ``url`` and, given
    ``settings``, its client ``timeout`` and ``max_retries`` set from them."""
    config = yaml.safe_load(Path(template).read_text())
    client = {} if settings is None else {"timeout": settings.timeout, "max_retries": settings.max_retries}
    for tool in config.get("tools", []):
        tool.setdefault("config", {}).update(retrieval_service_url=url, **client)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def build_launch(
    init_manifest: Mapping[str, Any],
    method: Mapping[str, Any],
    training: Mapping[str, Any],
    run_dir: str | Path,
    *,
    retrieval_url: str,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    python: str | None = None,
    train: pd.DataFrame | None = None,
    validation: pd.DataFrame | None = None,
) -> Launch:
    """Compose the VERL launch for one method (pure apart from writing the run's tool config copy
    and, when ``training.verl`` names no files, ``train``/``validation`` as parquet: :func:`data_files`)."""
    verl = verl_settings(training)
    check_worker_url(retrieval_url, verl.nnodes)
    config_dir = Path(verl.config_dir)
    run_dir = Path(run_dir)
    files = data_files(verl, run_dir, train, validation)
    tool_config = write_tool_config(config_dir / "tool_config" / "search_tool.yaml", retrieval_url,
                                    run_dir / "search_tool.yaml", verl.retrieval)
    params = verl_parameters(init_manifest, method, training, run_dir, tool_config_path=tool_config,
                             data_files=files)
    ray_address = verl.ray_address
    if ray_address:
        params["overrides"] = [*params["overrides"], f"++ray_kwargs.ray_init.address={ray_address}"]
    env = verl_environment(tracking_uri=tracking_uri, run_id=run_id, ray_address=ray_address)
    metrics_files = _metrics_to_files(params, env, run_dir) if run_id else []
    params["overrides"] = [*params["overrides"], *ray_env_overrides(env)]
    argv = main_ppo_argv(params, config_dir, python=python)
    return Launch(argv, env, run_dir / "verl.log", run_dir, extra={"params": params, "metrics_files": metrics_files})


def _metrics_to_files(params: dict[str, Any], env: dict[str, str], run_dir: Path) -> list[Path]:
    """verl's MLflow tracker logs each step synchronously (a down server blocks it, then drops the
    step): with a run to log into, verl's ``file`` tracker and our plugin's step metrics write local
    JSON lines instead, which :func:`launch_verl_training` ships through a buffered writer
    (docs/reliability.md). ``run_dir`` must be visible from the trainer's node, as for checkpoints."""
    if "mlflow" not in params["logger"]:
        return []
    params["logger"] = list(dict.fromkeys("file" if b == "mlflow" else b for b in params["logger"]))
    files = [(run_dir / "verl_metrics.jsonl").resolve(), (run_dir / "step_metrics.jsonl").resolve()]
    env["VERL_FILE_LOGGER_PATH"], env[METRICS_PATH_ENV] = str(files[0]), str(files[1])
    return files


def run_streaming(
    argv: Sequence[str], env: Mapping[str, str], log_path: str | Path, *, tail_lines: int = 80, timeout: float | None = None,
    cwd: str | Path | None = None,
) -> None:
    """Run ``argv``, streaming each output line to the logger and ``log_path``.

    Raises :class:`VerlLaunchError` with the last ``tail_lines`` lines when the process fails or
    exceeds ``timeout`` seconds (the process group is stopped).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    started = time.monotonic()
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)
        timer = None
        timed_out = threading.Event()
        if timeout:
            def _stop() -> None:
                timed_out.set()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
            timer = threading.Timer(timeout, _stop)
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                log_file.write(line + "\n")
                logger.info("[verl] %s", line)
            code = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
    if timed_out.is_set():
        raise VerlLaunchError(f"VERL exceeded {timeout} s and was stopped; last lines of {log_path}:\n" + "\n".join(tail))
    if code != 0:
        raise VerlLaunchError(
            f"VERL exited with code {code} after {time.monotonic() - started:.0f} s; last lines of {log_path}:\n"
            + "\n".join(tail)
        )


@contextlib.contextmanager
def _retrieval(verl: VerlSettings, index_manifest: Mapping[str, Any]) -> Iterator[str]:
    """The URL the agent-loop workers use: ``retrieval.url``, or a service started here for the run
    (its URL checked before it starts)."""
    with service_url(verl.retrieval, index_manifest.get("index_dir"),
                     check=lambda url: check_worker_url(url, verl.nnodes)) as url:
        yield url


def launch_verl_training(
    init_manifest: Mapping[str, Any],
    index_manifest: Mapping[str, Any],
    method: Mapping[str, Any],
    training: Mapping[str, Any],
    run_dir: str | Path,
    *,
    train: pd.DataFrame | None = None,
    validation: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """Run one VERL training to completion (GPU); return a manifest of its checkpoints.

    ``train``/``validation`` are the node's ``verl_train``/``verl_validation`` datasets, what verl
    reads unless ``training.verl`` names files (:func:`data_files`). VERL logs into the active MLflow
    run (the Kedro run) when there is one.
    """
    verl = verl_settings(training)
    run_id, tracking_uri = active_run_target()
    with _retrieval(verl, index_manifest) as url:
        launch = build_launch(
            init_manifest, method, training, run_dir, retrieval_url=url, tracking_uri=tracking_uri,
            run_id=run_id, train=train, validation=validation,
        )
        logger.info("launching VERL: %s", " ".join(launch.argv))
        files = launch.extra["metrics_files"]
        for path in files:  # a previous launch's lines: kept aside (backfill), not sent again
            if path.exists():
                path.replace(path.with_name(f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))
        with active_run_writer() as writer, follow_jsonl(files, writer):
            run_streaming(launch.argv, launch.env, launch.log_path, tail_lines=verl.log_tail_lines,
                          timeout=verl.timeout)
    checkpoints = Path(run_dir) / "checkpoints"
    steps = sorted(checkpoints.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[-1]))
    if not steps:
        raise VerlLaunchError(f"VERL finished but wrote no checkpoint under {checkpoints}")
    return {"backend": "verl", "method": method["method"], "checkpoint": str(steps[-1].resolve()),
            "actor_dir": str((steps[-1] / "actor").resolve()), "path": None,
            "run_dir": str(Path(run_dir).resolve()), "argv": launch.argv, "python": sys.executable}
