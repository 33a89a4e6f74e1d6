"""The VERL launcher on CPU: generated command and environment, composition with ``--cfg job``,
plugin registration with the launcher's environment, failure → error with the log tail.
A real launch needs GPUs and is marked ``gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from kedro.config import OmegaConfigLoader

from spader_pipeline.launch.command import PLUGIN_MODULE, build_launch, is_loopback_url, verl_environment
from spader_pipeline.launch.process import VerlLaunchError, run_streaming
from spader_pipeline.launch.settings import verl_settings
from spader_pipeline.retrieval.settings import RetrievalSettings
from spader_pipeline.training import TrainingSettings
from spader_pipeline.typed_config import SettingsError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def params():
    loader = OmegaConfigLoader(str(ROOT / "conf"), base_env="base", default_run_env="base")
    return loader["parameters"]


#: the node's verl_train / verl_validation datasets (what the launch writes for verl to read)
DATA = {"train": pd.DataFrame({"data_source": ["embedded"], "prompt": [[{"role": "user", "content": "q?"}]]}),
        "validation": pd.DataFrame({"data_source": ["embedded"], "prompt": [[{"role": "user", "content": "v?"}]]})}


def _checkpoint(path: Path, model_type: str = "qwen3") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


@pytest.fixture
def launch(params, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths in parameters are project-relative
    training = {**params["training"], "verl": {**params["training"]["verl"], "ray_address": "10.0.0.1:6379"}}
    # a Llama checkpoint: the composed command then also proves the llama3_8b schedule group composes
    return build_launch({"path": str(_checkpoint(tmp_path / "warm", "llama"))},
                        _method_launch(training, params["train_spader"]["method"]), tmp_path / "run", retrieval_url="http://127.0.0.1:8123", tracking_uri="sqlite:////tmp/x.db",
                        run_id="abc123", **DATA)


def _method_launch(training, method):
    """What the verl backend hands the launcher: the typed settings' launch of ``method``."""
    return TrainingSettings.from_mapping({**training, "backend": "verl"}, method).verl_launch()


def _launch(params, tmp_path, *, model_type="qwen3", url="http://127.0.0.1:8123", method="spader", **verl):
    training = {**params["training"], "verl": {**params["training"]["verl"], **verl}}
    return build_launch({"path": str(_checkpoint(tmp_path / "warm", model_type))},
                        _method_launch(training, params[f"train_{method}"]["method"]), tmp_path / "run",
                        retrieval_url=url, **DATA)


def test_loopback_retrieval_url_is_refused_on_several_nodes(params, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    _launch(params, tmp_path, nnodes=1)  # one node: loopback is fine
    for url in ("http://127.0.0.1:8123", "http://localhost:8000", "http://0.0.0.0:8000"):
        with pytest.raises(ValueError, match="loopback"):
            _launch(params, tmp_path, nnodes=2, url=url)
    launch = _launch(params, tmp_path, nnodes=2, url="http://10.0.0.5:8000")
    tool_cfg = next(a.split("=", 1)[1] for a in launch.argv if "multi_turn.tool_config_path=" in a)
    assert yaml.safe_load(Path(tool_cfg).read_text())["tools"][0]["config"]["retrieval_service_url"] == "http://10.0.0.5:8000"


def test_loopback_service_is_refused_before_it_starts():
    from spader_pipeline.launch.verl import _retrieval

    with pytest.raises(ValueError, match="loopback"), _retrieval(verl_settings({"nnodes": 2}),
                                                                 {"index_dir": "/no/such/index"}):
        pass


def test_started_service_binds_one_address_and_advertises_another():
    assert verl_settings({}).retrieval.advertised_url(8000) == "http://127.0.0.1:8000"
    settings = verl_settings({"retrieval": {"bind_host": "0.0.0.0", "advertised_host": "head-node.cluster"}})
    assert settings.retrieval.bind_host == "0.0.0.0"
    assert settings.retrieval.advertised_url(8000) == "http://head-node.cluster:8000"
    with pytest.raises(ValueError, match="advertised_host"):
        verl_settings({"retrieval": {"bind_host": "0.0.0.0"}})
    assert is_loopback_url("http://127.0.0.2:1") and not is_loopback_url("http://10.1.2.3:1")


def test_the_search_tools_settings_of_a_run_reach_its_tool_config(params, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    limits = {"topk": 3, "max_observation_chars": 1200, "max_document_chars": 120}
    launch = _launch(params, tmp_path, search_tool=limits)
    tool_cfg = next(a.split("=", 1)[1] for a in launch.argv
                    if a.startswith("actor_rollout_ref.rollout.multi_turn.tool_config_path="))
    config = yaml.safe_load(Path(tool_cfg).read_text())["tools"][0]["config"]
    assert {k: config[k] for k in limits} == limits and config["max_chars"] == 10000  # the rest: the template's
    from spader_pipeline.verl_plugin.search_tool import SearchTool

    assert SearchTool(config).rollout_config.max_document_chars == 120


def test_retrieval_is_the_shared_settings_block(params, tmp_path, monkeypatch):
    """training.verl.retrieval is the RetrievalSettings of training.search / evaluate.retrieval."""
    assert verl_settings(params["training"]["verl"]).retrieval == RetrievalSettings(mode="service")
    with pytest.raises(ValueError, match=r"unknown training.verl.retrieval settings \['host'\]"):
        verl_settings({"retrieval": {"host": "0.0.0.0"}})
    # the client settings reach the search tool's config of the run
    monkeypatch.chdir(ROOT)
    launch = _launch(params, tmp_path, retrieval={"timeout": 7.5, "max_retries": 1})
    tool_cfg = next(a.split("=", 1)[1] for a in launch.argv if "multi_turn.tool_config_path=" in a)
    tool = yaml.safe_load(Path(tool_cfg).read_text())["tools"][0]["config"]
    assert (tool["timeout"], tool["max_retries"], tool["retrieval_service_url"]) == (7.5, 1, "http://127.0.0.1:8123")


def test_plugin_and_mlflow_variables_reach_every_ray_worker(launch):
    """Workers of a pre-started cluster do not inherit the launching shell: forward via runtime_env."""
    prefix = "++ray_kwargs.ray_init.runtime_env.env_vars."
    forwarded = dict(a[len(prefix):].split("=", 1) for a in launch.argv if a.startswith(prefix))
    assert PLUGIN_MODULE in forwarded["VERL_USE_EXTERNAL_MODULES"]
    assert forwarded["MLFLOW_RUN_ID"] == "'abc123'" and forwarded["MLFLOW_TRACKING_URI"] == "'sqlite:////tmp/x.db'"


def test_model_family_from_the_checkpoint_and_no_dead_keys(params, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert "spader_model=llama3_8b" in _launch(params, tmp_path, model_type="llama").argv  # paper: 200 free steps
    assert "spader_model=qwen3_8b" in _launch(params, tmp_path, model_type="qwen3").argv
    assert "spader_model=qwen3_8b" in _launch(params, tmp_path, model_type="llama", model="qwen3_8b").argv
    with pytest.raises(ValueError, match="training.verl.model"):
        _launch(params, tmp_path, model_type="gpt2")
    with pytest.raises(ValueError, match="unknown training.verl settings \\['overlay'\\]"):
        _launch(params, tmp_path, overlay="spader_llama3_8b")


def test_launch_command_carries_method_model_reward_and_cluster(launch, tmp_path):
    argv = launch.argv
    assert argv[1:3] == ["-m", "verl.trainer.main_ppo"] and argv[argv.index("--config-name") + 1] == "method"
    assert "spader_method=spader" in argv
    assert "spader_model=llama3_8b" in argv
    assert f"actor_rollout_ref.model.path={tmp_path / 'warm'}" in argv
    assert "++reward.reward_kwargs.beta=4.0" in argv and "++algorithm.spa.gamma=0.9" in argv
    assert "++reward.reward_kwargs.cost_free_steps=100" in argv  # shared training.reward reaches VERL
    assert "++ray_kwargs.ray_init.address=10.0.0.1:6379" in argv
    assert argv[-1] == f"hydra.run.dir={(tmp_path / 'run' / 'hydra').resolve()}"  # Hydra writes into the run
    tool_cfg = next(a.split("=", 1)[1] for a in argv if a.startswith("actor_rollout_ref.rollout.multi_turn.tool_config_path="))
    tools = yaml.safe_load(Path(tool_cfg).read_text())["tools"]
    assert tools[0]["config"]["retrieval_service_url"] == "http://127.0.0.1:8123"
    assert launch.env["MLFLOW_RUN_ID"] == "abc123" and launch.env["MLFLOW_TRACKING_URI"] == "sqlite:////tmp/x.db"
    assert PLUGIN_MODULE in launch.env["VERL_USE_EXTERNAL_MODULES"].split(",")
    assert launch.env["RAY_ADDRESS"] == "10.0.0.1:6379"


def test_the_cpu_platform_loads_first_reaches_every_worker_and_comes_before_the_runs_overrides(params, tmp_path,
                                                                                              monkeypatch):
    """``training.verl.platform: cpu``: the CPU platform module before the plugin and ``VERL_PLATFORM=cpu``,
    in the launch and in every Ray worker; the ranks as Ray GPUs of the local Ray; the CPU's settings
    first, so the run's own overrides win; an unknown platform is refused."""
    from spader_pipeline.launch.command import CPU_PLATFORM_MODULE, cpu_platform_overrides

    monkeypatch.chdir(ROOT)
    launch = _launch(params, tmp_path, platform="cpu", n_gpus_per_node=2,
                     overrides=["actor_rollout_ref.rollout.name=my_engine"])
    assert launch.env["VERL_PLATFORM"] == "cpu"
    assert launch.env["VERL_USE_EXTERNAL_MODULES"].split(",")[:2] == [CPU_PLATFORM_MODULE, PLUGIN_MODULE]
    assert "++ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM='cpu'" in launch.argv
    assert "++ray_kwargs.ray_init.num_gpus=2" in launch.argv
    cpu = cpu_platform_overrides(2)
    assert all(o in launch.argv for o in cpu)
    ours, theirs = launch.argv.index("actor_rollout_ref.rollout.name=spader_decoder"), launch.argv.index(
        "actor_rollout_ref.rollout.name=my_engine")
    assert ours < theirs
    on_a_cluster = _launch(params, tmp_path, platform="cpu", ray_address="10.0.0.1:6379")
    assert not any("ray_init.num_gpus" in a for a in on_a_cluster.argv)  # the cluster declares its own
    assert "VERL_PLATFORM" not in _launch(params, tmp_path).env
    with pytest.raises(ValueError, match="platform='tpu'"):
        _launch(params, tmp_path, platform="tpu")


def test_environment_keeps_other_external_modules():
    env = verl_environment(tracking_uri=None, run_id=None, base={"VERL_USE_EXTERNAL_MODULES": "other.mod"})
    assert env["VERL_USE_EXTERNAL_MODULES"] == f"other.mod,{PLUGIN_MODULE}" and "MLFLOW_RUN_ID" not in env


@pytest.mark.slow
@pytest.mark.verl_workers  # verl's CLI in a process of its own: make test-verl's tier
def test_generated_command_composes_with_cfg_job(launch, tmp_path):
    """verl's real CLI (``python -m verl.trainer.main_ppo ... --cfg job``) composes the launcher's
    command: the spader overlay with the llama3_8b schedule group and the Kedro overrides on top."""
    proc = subprocess.run([*launch.argv, "--cfg", "all"], capture_output=True, text=True, timeout=300,
                          env=launch.env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["algorithm"]["adv_estimator"] == "spa"
    assert cfg["hydra"]["run"]["dir"] == str((tmp_path / "run" / "hydra").resolve())  # not ./outputs/<date>
    assert cfg["actor_rollout_ref"]["model"]["path"] == str(tmp_path / "warm")
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1.0e-5  # the llama3_8b schedule group
    assert cfg["reward"]["reward_kwargs"]["cost_free_steps"] == 100  # Kedro's shared value wins over the group's
    assert cfg["trainer"]["rollout_data_dir"] == str(tmp_path / "run" / "rollouts")
    assert cfg["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_manager_class"].endswith(
        "GroupRewardAgentLoopManager"
    )
    assert cfg["trainer"]["default_local_dir"] == str(tmp_path / "run" / "checkpoints")
    assert cfg["ray_kwargs"]["ray_init"]["address"] == "10.0.0.1:6379"
    # with a run to log into, verl writes its metrics to a file the launcher ships (docs/reliability.md)
    assert "file" in cfg["trainer"]["logger"] and "mlflow" not in cfg["trainer"]["logger"]


@pytest.mark.slow
@pytest.mark.verl_workers  # verl's CLI in a process of its own: make test-verl's tier
def test_a_cpu_launch_composes_with_cfg_job(params, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    launch = _launch(params, tmp_path, platform="cpu", n_gpus_per_node=1)
    proc = subprocess.run([*launch.argv, "--cfg", "job"], capture_output=True, text=True, timeout=300,
                          env=launch.env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["ray_kwargs"]["ray_init"]["num_gpus"] == 1 and cfg["trainer"]["device"] == "cpu"
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "spader_decoder"
    assert cfg["actor_rollout_ref"]["actor"]["strategy"] == "fsdp2"
    assert cfg["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] == "sdpa"
    # Ray takes the workers' variables as strings only: HF_HUB_OFFLINE=1 stays "1", not the integer 1
    env_vars = cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert env_vars["HF_HUB_OFFLINE"] == "1" and env_vars["VERL_PLATFORM"] == "cpu"


def test_failure_becomes_an_error_with_the_log_tail(tmp_path):
    script = "import sys\nfor i in range(200): print('line', i)\nsys.exit(3)"
    with pytest.raises(VerlLaunchError, match=r"code 3[\s\S]*line 199") as info:
        run_streaming([sys.executable, "-c", script], dict(os.environ), tmp_path / "verl.log", tail_lines=5)
    assert "line 190" not in str(info.value)
    assert (tmp_path / "verl.log").read_text().count("\n") == 200


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_timeout_stops_the_process_group(tmp_path):
    """VERL spawns workers (Ray): the timeout must stop them too, not only the launched process."""
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('start', flush=True)\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(VerlLaunchError, match="exceeded"):
        run_streaming([sys.executable, "-c", script], dict(os.environ), tmp_path / "verl.log", timeout=3)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


@pytest.mark.gpu
@pytest.mark.skipif(not {"SPADER_TEST_MODEL", "SPADER_TEST_INDEX"} <= set(os.environ),
                    reason="set SPADER_TEST_MODEL and SPADER_TEST_INDEX (docs/gpu.md)")
def test_real_verl_launch_two_steps(params, tmp_path):  # pragma: no cover - needs GPUs, vLLM/SGLang
    from spader_pipeline.launch.verl import launch_verl_training

    training = {**params["training"], "verl": {**params["training"]["verl"], "n_gpus_per_node": 1,
                                               "overrides": ["trainer.total_training_steps=2", "trainer.save_freq=2"]}}
    manifest = launch_verl_training({"path": os.environ["SPADER_TEST_MODEL"]},
                                    {"index_dir": os.environ["SPADER_TEST_INDEX"]},
                                    _method_launch(training, params["train_spader"]["method"]), tmp_path)
    assert Path(manifest["actor_dir"]).is_dir()


def test_a_method_is_one_key_on_verl(params, tmp_path, monkeypatch):
    """The estimator and the reward layout come from ``spader_method`` alone: a command line that sets
    either apart stops in the launcher, before the process (and Ray) starts, naming the two keys."""
    from spader_pipeline.launch import verl as launcher

    monkeypatch.chdir(ROOT)
    started = []
    monkeypatch.setattr(launcher, "run_streaming", lambda *a, **k: started.append(a))
    argv = _launch(params, tmp_path).argv
    assert "spader_method=spader" in argv and not any("adv_estimator" in a for a in argv)
    bad = [(["algorithm.adv_estimator=grpo"], r"algorithm.adv_estimator=grpo.*spader_method=spader"),
           (["++reward.reward_kwargs.method=grpo"], r"reward.reward_kwargs.method=grpo.*spader_method=spader"),
           (["spader_method=grpo"], r"spader_method=grpo.*spader_method=spader")]
    for overrides, message in bad:
        with pytest.raises(SettingsError, match=message):
            _launch(params, tmp_path, overrides=overrides)
        training = {**params["training"], "verl": {**params["training"]["verl"], "overrides": overrides,
                                                   "retrieval": {"url": "http://127.0.0.1:9/"}}}
        with pytest.raises(SettingsError, match=message):
            launcher.launch_verl_training({"path": str(_checkpoint(tmp_path / "warm"))}, {},
                                          _method_launch(training, params["train_spader"]["method"]),
                                          tmp_path / "run", train=DATA["train"], validation=DATA["validation"])
    assert started == []
    # the method's own estimator, set again by hand, agrees: nothing to refuse
    _launch(params, tmp_path, method="grpo", overrides=["algorithm.adv_estimator=grpo"])


