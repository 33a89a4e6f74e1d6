"""What the verl trainer-loop tests share: a tiny workspace, the project's verl config composed as the
launcher composes it, a local Ray session, and one ``TaskRunner.run`` (verl's ``fit()``).

Two kinds of run use it:

* **with verl's real workers** (``test_verl_real_workers.py``, ``make test-verl``): verl's own
  ``ActorRolloutRefWorker`` (FSDP2 on gloo), our decoder as the rollout server, verl's checkpoint engine,
  on the CPU platform of :mod:`spader_pipeline.verl_plugin.cpu` (:data:`REAL_WORKER_OVERRIDES`);
* **with the stand-ins** of :mod:`verl_cpu_boundary` (``test_verl_trainer_loop.py``, in ``make test``):
  a scripted LLM server, a recording worker group, no weight sync; fast, and the server plays a search
  agent whose behaviour the assertions know.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pandas as pd

from spader_pipeline.launch.command import cpu_platform_overrides
from spader_pipeline.local_ray import init_local_ray

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

PROMPT_LENGTH, RESPONSE_LENGTH, MAX_MODEL_LEN = 512, 256, 768

DOCS = [
    ("Ghana", "Country in West Africa. Accra is the capital of Ghana."),
    ("Togo", "Country in West Africa. Lome is the capital of Togo."),
    ("Benin", "Country in West Africa. Porto-Novo is the capital of Benin."),
    ("Senegal", "Country in West Africa. Dakar is the capital of Senegal."),
    ("Kenya", "Country in East Africa. Nairobi is the capital of Kenya."),
    ("Hamlet", "Play by William Shakespeare. A prince of Denmark seeks revenge."),
]
QUESTIONS = [
    ("train", "t0", "Which countries are in West Africa?", [["Ghana"], ["Togo"], ["Benin"], ["Senegal"]]),
    ("train", "t1", "Which country has Nairobi as its capital?", [["Kenya"]]),
    ("train", "t2", "Which plays did William Shakespeare write?", [["Hamlet"]]),
    ("train", "t3", "Which West Africa country has Dakar as capital?", [["Senegal"]]),
    ("validation", "v0", "Which countries in West Africa have a capital?", [["Ghana"], ["Togo"], ["Benin"]]),
    ("validation", "v1", "Which play is about a prince of Denmark?", [["Hamlet"]]),
    ("validation", "v2", "Which country in East Africa is there?", [["Kenya"]]),
]

#: verl's real workers on the CPU platform, as the launcher runs them (``training.verl.platform: cpu``,
#: :func:`~spader_pipeline.launch.command.cpu_platform_overrides`), in fp32 on both sides (so the
#: server's log-probs equal the actor's)
REAL_WORKER_OVERRIDES = (
    *cpu_platform_overrides(None),  # the tests start their own Ray (local_ray)
    "actor_rollout_ref.rollout.dtype=float32",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
)

#: the stand-ins' weight sync (:class:`verl_cpu_boundary.NoopCheckpointManager`)
BOUNDARY_OVERRIDES = ("+actor_rollout_ref.rollout.checkpoint_manager_class=verl_cpu_boundary.NoopCheckpointManager",)


def template() -> str:
    import yaml

    from spader_pipeline.agent.prompts import resolve_template

    return resolve_template(yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"])


@contextmanager
def trainer_loop_workspace(root: Path):
    """Tiny Qwen3 + tokenizer, a 6-document BM25 index served on 127.0.0.1, VERL parquet files."""
    from spader_pipeline.data.formats import verl_rows
    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model
    from spader_pipeline.retrieval import build_index_from_file, running_service

    prompt = template()
    texts = [f"{t}\n{c}" for t, c in DOCS] + [prompt] + [q for *_, q, _ in QUESTIONS]
    texts += ['<think>I should search.</think><tool_call>["x"]</tool_call><answer>["Ghana"]</answer>'] * 3
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=4096)
    model_dir = build_base_model(texts, root / "model", spec=spec, vocab_size=700, min_frequency=1)

    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": t, "contents": c}) + "\n"
                              for i, (t, c) in enumerate(DOCS)))
    build_index_from_file(corpus, root / "bm25", "bm25")

    qa = pd.DataFrame([{"split": s, "id": i, "question": q, "ground_truth": gt, "data_source": "embedded"}
                       for s, i, q, gt in QUESTIONS])
    data = root / "verl"
    data.mkdir()
    verl_rows(qa, "train", prompt, "spader_search").to_parquet(data / "train.parquet")
    verl_rows(qa, "validation", prompt, "spader_search").to_parquet(data / "validation.parquet")

    with running_service(root / "bm25") as url:
        yield {"root": root, "model": model_dir, "data": data, "url": url}


def project_parameters() -> dict:
    from kedro.config import OmegaConfigLoader

    return OmegaConfigLoader(str(ROOT / "conf"), base_env="base", default_run_env="base")["parameters"]


def method_block(method: str, tool_cost: float | None = None) -> dict:
    """``train_<method>.method`` of the project's parameters (its tool cost set to ``tool_cost`` where
    the method pays one)."""
    block = dict(project_parameters()[f"train_{method}"]["method"])
    reward = dict(block.get("reward") or {})
    if reward.get("tool_round_cost") and tool_cost is not None:
        reward["tool_round_cost"] = tool_cost
    return {**block, "reward": reward}


def compose_config(block: Mapping[str, Any], ws: Mapping[str, Any], run_dir: Path, *, overrides: Iterable[str] = (),
                   reward: Mapping[str, Any] | None = None, validation: Mapping[str, Any] | None = None,
                   steps: int = 2, config_dir: Path = ROOT / "conf/base/verl", n_gpus_per_node: int = 1):
    """``<config_dir>/method.yaml`` + the launcher's overrides for the method ``block`` (a
    ``train_<method>.method`` block) + CPU-test sizes + ``overrides``, composed by Hydra."""
    from hydra import compose, initialize_config_dir

    from spader_pipeline.launch.command import verl_parameters
    from spader_pipeline.launch.data_files import write_tool_config
    from spader_pipeline.launch.overrides import build_overrides, overlay_name
    from spader_pipeline.training import TrainingSettings

    tool_config = write_tool_config(ROOT / "conf/base/verl/tool_config/search_tool.yaml", ws["url"],
                                    run_dir / "search_tool.yaml")
    shared = project_parameters()["training"]
    training = {
        "reward": {**shared["reward"], **dict(reward or {})},
        # the shared validation block, mapped by the launcher to test_freq / val_before_train / val_kwargs
        "validation": dict(validation or {"every": 2, "before_train": True, "max_questions": None}),
        "verl": {
            "train_files": str(ws["data"] / "train.parquet"),
            "val_files": str(ws["data"] / "validation.parquet"),
            "n_gpus_per_node": n_gpus_per_node,
            "nnodes": 1,
            "logger": ["file"],
            "total_training_steps": steps,
            "config_dir": str(ROOT / "conf/base/verl"),
            "overrides": [
                "data.train_batch_size=2",
                f"data.max_prompt_length={PROMPT_LENGTH}",
                f"data.max_response_length={RESPONSE_LENGTH}",
                "data.dataloader_num_workers=0",
                "actor_rollout_ref.rollout.n=4",
                f"actor_rollout_ref.rollout.max_model_len={MAX_MODEL_LEN}",
                "actor_rollout_ref.rollout.agent.num_workers=1",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
                "reward.num_workers=1",
                "trainer.save_freq=-1",
                "trainer.resume_mode=disable",
                "trainer.device=cpu",
                *overrides,
            ],
        },
    }
    launch = TrainingSettings.from_mapping({**training, "backend": "verl"}, dict(block)).verl_launch()
    params = verl_parameters({"path": str(ws["model"])}, launch, run_dir, tool_config_path=tool_config)
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=overlay_name(params), overrides=build_overrides(params))


@contextmanager
def local_ray(*, gpus: int = 0, paths: Sequence[Path] = (), modules: Sequence[str] = (), cpu_platform: bool = False,
              env: Mapping[str, str] | None = None):
    """A local Ray whose workers find the test helpers (and ``paths``) on PYTHONPATH and load the plugin
    only through the launcher's ``VERL_USE_EXTERNAL_MODULES`` (entry points off), plus ``modules``.
    ``cpu_platform``: verl's workers run on the CPU platform, ``gpus`` trainer slots declared as Ray GPUs
    (:mod:`spader_pipeline.verl_plugin.cpu`)."""
    import ray

    from spader_pipeline.launch.command import verl_environment

    if ray.is_initialized():
        ray.shutdown()
    pythonpath = [str(HERE), *map(str, paths), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    external = [verl_environment(tracking_uri=None, run_id=None, base={})["VERL_USE_EXTERNAL_MODULES"], *modules]
    kwargs: dict[str, Any] = {"num_cpus": 4 + 3 * gpus}  # verl's bundles ask for 3 CPUs a rank
    settings = {
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VERL_LOGGING_LEVEL": "WARN",
        "VERL_USE_EXTERNAL_PLUGINS": "none",
    }
    if cpu_platform:
        from spader_pipeline.verl_plugin import cpu

        external.insert(0, cpu.MODULE)
        settings.update(cpu.environment())
        kwargs = {**kwargs, **cpu.ray_init_kwargs(gpus)}
    settings["VERL_USE_EXTERNAL_MODULES"] = ",".join(external)
    settings.update(env or {})
    # Through the environment Ray's own processes inherit, not a job runtime_env: a job with one gets
    # fresh workers set up for it, and the workers Ray pre-starts at init would sit idle (each is a
    # Python process importing ray); without one they host the first actors.
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        init_local_ray(include_dashboard=False, log_to_driver=False, **kwargs)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        with cpu_platform_in_driver() if cpu_platform else nullcontext():
            yield
    finally:
        ray.shutdown()


@contextmanager
def cpu_platform_in_driver():
    """verl's CPU platform in this process too (the driver runs verl's trainer and launches the servers),
    whatever platform the process resolved before; restored afterwards."""
    from verl.plugin.platform import platform_manager

    from spader_pipeline.verl_plugin import cpu

    previous, saved = platform_manager._current_platform, {k: os.environ.get(k) for k in cpu.environment()}
    os.environ.update(cpu.environment())
    platform_manager._current_platform = cpu.PlatformCPU()
    try:
        yield
    finally:
        platform_manager._current_platform = previous
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def run_fit(config, run_dir: Path, *, task_runner: type | None = None, keep_actors: Sequence[str] = (),
            before_cleanup=None) -> list[dict]:
    """verl's ``main()`` checks and its legacy ``TaskRunner.run`` (``fit()``) in this process, with
    ``task_runner`` (a ``BaseTaskRunner`` subclass; verl's own by default); returns the metrics verl's
    file tracker logged. Afterwards (``before_cleanup()`` first, e.g. to read the servers' records)
    verl's named actors are killed (their names are free for the next run), but those in ``keep_actors``."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner, TaskRunner
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if task_runner is None:
        class task_runner(BaseTaskRunner):  # noqa: N801 (a class bound to the argument name)
            run = TaskRunner.__ray_metadata__.modified_class.run  # verl's own, unchanged
    metrics_path = run_dir / "metrics.jsonl"
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    try:
        task_runner().run(config)
        if before_cleanup is not None:
            before_cleanup()
    finally:
        os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        kill_named_actors(keep=keep_actors)
    return [json.loads(line) for line in metrics_path.read_text().splitlines()]


def kill_named_actors(keep: Sequence[str] = ()) -> None:
    """verl names its workers (``reward_loop_worker_0``, servers, …) and the placement groups of its
    resource pools: free the names (and the slots) for the next run."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for group_id, group in ray.util.placement_group_table().items():
        if group.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"] in keep:
            continue
        try:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
        except ValueError:  # it exited between the listing and the lookup: its name is free
            pass


def print_timing(label: str, seconds: float) -> None:
    print(f"{label}: {seconds:.1f} s", file=sys.stderr)
