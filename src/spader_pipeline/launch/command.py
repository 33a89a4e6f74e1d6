"""The verl command line of one method's launch: the typed settings (:class:`~.settings.MethodLaunch`)
→ ``main_ppo``'s parameters (:func:`verl_parameters`, then :func:`~spader_pipeline.launch.overrides.main_ppo_argv`), the
environment of the process and of every Ray worker, and the checks on what the workers will reach
(model family, retrieval URL). :func:`build_launch` puts them together (pure apart from writing the
run's data files)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from spader_pipeline.launch.data_files import DATA_KEYS, data_files, write_tool_config
from spader_pipeline.launch.metrics import metrics_to_files
from spader_pipeline.launch.overrides import main_ppo_argv
from spader_pipeline.launch.settings import MethodLaunch
from spader_pipeline.tracking.metrics_files import METRICS_PATH_ENV

if TYPE_CHECKING:
    import pandas as pd

PLUGIN_MODULE = "spader_pipeline.verl_plugin"
#: loaded before the plugin where verl runs on the CPU (it registers the platform verl resolves first)
CPU_PLATFORM_MODULE = "spader_pipeline.verl_plugin.cpu"

#: Hugging Face ``model_type`` → the paper schedule group ``conf/base/verl/spader_model/<name>.yaml``
MODEL_FAMILIES = {"qwen3": "qwen3_8b", "qwen2": "qwen3_8b", "llama": "llama3_8b"}
#: environment variables of the launch that every Ray worker needs too
FORWARDED_ENV = ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "HF_HUB_OFFLINE",
                 "TOKENIZERS_PARALLELISM", "VERL_FILE_LOGGER_PATH", METRICS_PATH_ENV)


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
    launch: MethodLaunch,
    run_dir: str | Path,
    *,
    tool_config_path: str | Path | None = None,
    data_files: Mapping[str, str | Path] | None = None,
) -> dict[str, Any]:
    """The parameter dict of :func:`~spader_pipeline.launch.overrides.build_overrides` for one method.

    Everything comes from ``launch``, typed: the method, its reward settings and options as the
    native trainer's configuration holds them (every field, so verl runs exactly those values), the
    validation schedule, and ``training.verl``'s cluster settings. ``data_files`` (``train_files``,
    ``val_files``; :func:`data_files`) default to ``training.verl.train_files``/``val_files``, which
    must then be set.
    """
    verl = launch.verl
    files = dict(data_files or {})
    for key in DATA_KEYS:
        files.setdefault(key, getattr(verl, key))
        if not files[key]:
            raise ValueError(f"no {key} for verl: set training.verl.{key} or pass the node's dataset")
    params: dict[str, Any] = {
        "method": launch.method,
        "model_path": str(Path(init_manifest["path"]).resolve()),
        "train_files": str(Path(files["train_files"]).resolve()),
        "val_files": str(Path(files["val_files"]).resolve()),
        "n_gpus_per_node": int(verl.n_gpus_per_node),
        "nnodes": int(verl.nnodes),
        "run_dir": str(Path(run_dir).resolve()),
        "experiment_name": f"train_{launch.method}",
        "logger": list(verl.logger),
        "reward": reward_kwargs(launch),
        "options": dataclasses.asdict(launch.options),
        "validation": launch.validation,
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


def reward_kwargs(launch: MethodLaunch) -> dict[str, Any]:
    """The reward manager's settings of the method: every field of its typed reward settings but
    ``enable_exploration``, which the method decides (the reward manager reads it from the method)."""
    values = dataclasses.asdict(launch.reward)
    values.pop("enable_exploration")
    return values


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
    """Hydra overrides forwarding :data:`FORWARDED_ENV` of ``env`` to every Ray worker, each value quoted:
    Ray takes strings only, and Hydra would read ``HF_HUB_OFFLINE=1`` as the integer 1."""
    return [f"++ray_kwargs.ray_init.runtime_env.env_vars.{key}={_quoted(env[key])}"
            for key in FORWARDED_ENV if env.get(key)]


def _quoted(value: str) -> str:
    """``value`` as a quoted string in Hydra's override grammar."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def cpu_platform_overrides(ranks: int | None) -> list[str]:
    """What verl's workers need to run on the CPU (docs/training.md, "verl on a CPU"), before the run's
    own overrides: the ``ranks`` trainer ranks of the local Ray declared as the Ray GPUs verl's resource
    pools ask for (``None``: a cluster started elsewhere declares them), FSDP2 (FSDP1 refuses CPU
    parameters), sdpa attention (verl's default is flash-attention 2), our decoder as the rollout server
    with its log-probs, and no torch.compile (a CPU compile costs more than a short run saves)."""
    local = [] if ranks is None else [
        f"++ray_kwargs.ray_init.num_gpus={int(ranks)}",
        # verl's resource pools ask for 3 CPUs a rank, its agent-loop and reward workers for more: Ray's
        # CPUs are slots, not cores, so a 2-core laptop gets enough of them
        f"++ray_kwargs.ray_init.num_cpus={max(os.cpu_count() or 1, 4 + 3 * int(ranks))}",
    ]
    return [
        *local,
        "trainer.device=cpu",
        "actor_rollout_ref.rollout.name=spader_decoder",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false",
    ]


def verl_environment(
    *, tracking_uri: str | None, run_id: str | None, ray_address: str | None = None, base: Mapping[str, str] | None = None,
    platform: str | None = None,
) -> dict[str, str]:
    """Environment of the VERL process (``base`` defaults to this process's environment); ``platform``
    ``"cpu"``: the CPU platform module first and ``VERL_PLATFORM=cpu``."""
    env = dict(os.environ if base is None else base)
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if PLUGIN_MODULE not in modules:
        modules.append(PLUGIN_MODULE)
    if platform == "cpu":
        modules = [CPU_PLATFORM_MODULE, *(m for m in modules if m != CPU_PLATFORM_MODULE)]
        env["VERL_PLATFORM"] = "cpu"
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


def build_launch(
    init_manifest: Mapping[str, Any],
    launch: MethodLaunch,
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
    and, when ``training.verl`` names no files, ``train``/``validation`` as parquet: :func:`data_files`).
    A command line that sets the method's estimator or reward layout apart from its one key stops
    here, before Ray starts (:func:`~spader_pipeline.launch.overrides.build_overrides`)."""
    verl = launch.verl
    check_worker_url(retrieval_url, verl.nnodes)
    config_dir = Path(verl.config_dir)
    run_dir = Path(run_dir)
    files = data_files(verl, run_dir, train, validation)
    tool_config = write_tool_config(config_dir / "tool_config" / "search_tool.yaml", retrieval_url,
                                    run_dir / "search_tool.yaml", verl.retrieval, tool=verl.search_tool)
    params = verl_parameters(init_manifest, launch, run_dir, tool_config_path=tool_config, data_files=files)
    ray_address = verl.ray_address
    if verl.platform == "cpu":  # the run's own overrides after these
        ranks = None if ray_address else verl.n_gpus_per_node
        params["overrides"] = [*cpu_platform_overrides(ranks), *params["overrides"]]
    if ray_address:
        params["overrides"] = [*params["overrides"], f"++ray_kwargs.ray_init.address={ray_address}"]
    env = verl_environment(tracking_uri=tracking_uri, run_id=run_id, ray_address=ray_address, platform=verl.platform)
    metrics_files = metrics_to_files(params, env, run_dir) if run_id else []
    # Hydra's own output folder (.hydra/, main_ppo.log) in the run, not in whichever directory launched it
    params["overrides"] = [*params["overrides"], *ray_env_overrides(env), f"hydra.run.dir={run_dir.resolve() / 'hydra'}"]
    argv = main_ppo_argv(params, config_dir, python=python)
    return Launch(argv, env, run_dir / "verl.log", run_dir, extra={"params": params, "metrics_files": metrics_files})
