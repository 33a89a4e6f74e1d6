"""verl trains for real on the CPU: ``fit()`` with verl's own workers, our rollout server, verl's weight sync.

Real, all of it: verl's ``TaskRunner.run`` → ``RayPPOTrainer.fit()`` with its ``ActorRolloutRefWorker``
(FSDP2 actor and reference over gloo), its checkpoint engine (``naive``: actor and rollout share the
device) moving the actor's weights into our ``spader_decoder`` rollout server after every update, verl's
LLM-server manager routing the agent loop's turns to that server, our agent loop, reward manager and
estimators, on the CPU platform of :mod:`spader_pipeline.verl_plugin.cpu`. Nothing is replaced.

What each run shows:

* **weights reach the server at every step**: each replica's server records one weight update at the
  start and one after each step, each with weights different from the last (the actor trained);
  with two ranks both replicas hold the same weights after every update;
* **the server computes what the actor computes**: verl's ``training/rollout_probs_diff_max`` (the
  largest gap between the probability the server reported for a sampled token and the one verl's actor
  recomputes for it) stays under :data:`PROBS_DIFF_BOUND` at every step; fp32 on both sides. A wrong
  token layout (a shifted token, an observation counted as a model token) would move it to O(1).

GRPO and SPADER at world size 1, SPADER at world size 2 (two FSDP2 ranks, two replicas), in one Ray
session; ``make test-verl`` runs this module (beside ``make test`` in CI: it takes minutes).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from verl_loop_support import (  # noqa: E402
    REAL_WORKER_OVERRIDES,
    compose_config,
    local_ray,
    method_block,
    print_timing,
    run_fit,
    trainer_loop_workspace,
)

pytestmark = [pytest.mark.verl_workers, pytest.mark.slow, pytest.mark.e2e]

#: the largest ``training/rollout_probs_diff_max`` allowed: both sides in fp32 on one CPU, the measured
#: gap is ~2e-9 (the same weights, the same tokens, different kernels and batch shapes)
PROBS_DIFF_BOUND = 1e-5
RUNS = {"grpo-1": ("grpo", 1), "spader-1": ("spader", 1), "spader-2": ("spader", 2)}
STEPS = 2


@pytest.fixture(scope="module")
def cpu_ray(workspace):
    with local_ray(gpus=2, cpu_platform=True):
        yield


def server_records(replicas: int) -> list[dict]:
    """Each replica's server: its weight updates and request counts (:meth:`DecoderServer.stats`)."""
    from spader_pipeline.verl_plugin.decoder_rollout import server_actor_name

    return ray.get([ray.get_actor(server_actor_name(rank)).stats.remote() for rank in range(replicas)])


@pytest.fixture(scope="module")
def runs(workspace, cpu_ray, tmp_path_factory):
    out = {}
    for name, (method, world) in RUNS.items():
        run_dir = tmp_path_factory.mktemp(f"run-{name}")
        config = compose_config(method_block(method), workspace, run_dir, steps=STEPS, n_gpus_per_node=world,
                                overrides=REAL_WORKER_OVERRIDES)
        servers: list[dict] = []
        start = time.perf_counter()
        metrics = run_fit(config, run_dir, before_cleanup=lambda s=servers, w=world: s.extend(server_records(w)))
        print_timing(f"{name}: fit() with verl's workers", time.perf_counter() - start)
        out[name] = {"metrics": metrics, "servers": servers, "world": world}
    return out


@pytest.mark.parametrize("name", RUNS)
def test_fit_trains_with_verls_workers_and_validates(runs, name):
    run = runs[name]
    assert [m["step"] for m in run["metrics"]] == [0, 1, 2]  # validation before training, then 2 steps
    for data in (m["data"] for m in run["metrics"][1:]):
        assert {"actor/pg_loss", "timing_s/update_actor", "timing_s/old_log_prob", "timing_s/ref",
                "timing_s/update_weights"} <= set(data)
        assert data["response_length/mean"] > 0


@pytest.mark.parametrize("name", RUNS)
def test_new_weights_reach_every_server_at_every_step(runs, name):
    servers = runs[name]["servers"]
    assert len(servers) == runs[name]["world"]
    for server in servers:
        updates = server["weight_updates"]
        assert [u["global_steps"] for u in updates] == list(range(STEPS + 1)), updates  # the start, each step
        checksums = [u["checksum"] for u in updates]
        assert all(a != b for a, b in zip(checksums, checksums[1:], strict=False)), checksums  # the actor trained between
        assert server["requests"] > 0 and server["global_steps"] == STEPS
    # every replica holds the same weights after each update (one actor, gathered from its shards)
    assert len({tuple(u["checksum"] for u in s["weight_updates"]) for s in servers}) == 1


@pytest.mark.parametrize("name", RUNS)
def test_the_servers_log_probs_are_the_actors(runs, name):
    for data in (m["data"] for m in runs[name]["metrics"][1:]):
        assert data["training/rollout_probs_diff_valid"] == 1
        assert data["training/rollout_probs_diff_max"] < PROBS_DIFF_BOUND, data["training/rollout_probs_diff_max"]


#: the methods the GPU run trains, one after the other in one Ray session (issue 63: GRPO and SPADER)
GPU_METHODS = ("grpo", "spader")


def selected_gpu_methods(items) -> list[str]:
    """The methods of :data:`GPU_METHODS` whose GPU test the session runs (``-k`` may select one)."""
    chosen = {item.callspec.params["method"] for item in items
              if getattr(item, "originalname", "") == "test_fit_on_one_gpu_with_our_server" and hasattr(item, "callspec")}
    return [method for method in GPU_METHODS if method in chosen]


@pytest.fixture(scope="module")
def gpu_runs(request, tmp_path_factory):  # pragma: no cover - needs a CUDA GPU
    """The same ``fit()`` on one GPU (verl's CUDA platform, detected), SmolLM2 from the wheel, 2 steps per
    method the session's tests select (``-k "fit_on_one_gpu and spader"``: SPADER alone, half the time), our
    server on CUDA as the rollout engine (no vLLM or SGLang installed)."""
    from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model

    root = tmp_path_factory.mktemp("gpu")
    out = {}
    with trainer_loop_workspace(root / "ws") as ws:
        model = root / "smollm2"
        convert_packaged_model(PackagedModel(), model)
        ws = {**ws, "model": model}
        overrides = [o for o in REAL_WORKER_OVERRIDES if o not in ("trainer.device=cpu",)
                     and "fsdp_config.mixed_precision" not in o and "rollout.dtype" not in o]
        with local_ray(gpus=1):
            for method in selected_gpu_methods(request.session.items):
                run_dir = root / method
                run_dir.mkdir()
                config = compose_config(method_block(method), ws, run_dir, steps=STEPS,
                                        overrides=[*overrides, "trainer.device=cuda"])
                servers: list[dict] = []
                start = time.perf_counter()
                metrics = run_fit(config, run_dir, before_cleanup=lambda s=servers: s.extend(server_records(1)))
                print_timing(f"{method}: fit() on one GPU", time.perf_counter() - start)
                out[method] = {"metrics": metrics, "servers": servers}
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", GPU_METHODS)
def test_fit_on_one_gpu_with_our_server(gpu_runs, method):  # pragma: no cover - needs a CUDA GPU
    """New weights reach the server at every step, the server's log-probs are the actor's (bf16 on both
    sides: a looser bound), and the server decodes in CUDA graphs (unless ``SPADER_CUDA_GRAPHS=off`` or
    ``SPADER_STATIC_DECODE=off`` chose otherwise). Prints each step's times and the server's throughput
    (docs/gpu.md: generation ≤ 5 s a step is issue 63's target at this shape)."""
    from spader_pipeline.modeling import static_cache

    run = gpu_runs[method]
    server = run["servers"][0]
    assert [u["global_steps"] for u in server["weight_updates"]] == list(range(STEPS + 1))
    for step, data in ((m["step"], m["data"]) for m in run["metrics"][1:]):
        print(method, step, {k: round(v, 2) for k, v in data.items() if k.startswith("timing_s/")})
        assert data["training/rollout_probs_diff_max"] < 0.1
    sizes, seconds = server["batch_sizes"], server["decode_seconds"]
    steps = max(server["decode_steps"], 1)
    print(f"{method}: the server decoded {server['generated_tokens']} tokens in {seconds:.1f} s "
          f"({server['generated_tokens'] / max(seconds, 1e-9):.0f} tokens/s) in {len(sizes)} batches of "
          f"{min(sizes, default=0)}-{max(sizes, default=0)} requests: {server['decode_steps']} decoding steps of "
          f"{server['sampled_rows'] / steps:.1f} rows on average, {1000 * server['model_seconds'] / steps:.1f} ms "
          f"each in the model (prefills and captures included; the prefills {server['prefill_seconds']:.1f} s, "
          f"the decoding steps {server['decoding_seconds']:.1f} s); static step: {server['decoding']}")
    if static_cache.STATIC_DECODE != "off" and static_cache.CUDA_GRAPHS:
        assert server["decoding"]["replays"] > 0, server["decoding"]
