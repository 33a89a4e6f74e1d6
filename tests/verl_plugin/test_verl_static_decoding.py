"""verl's ``fit()`` with our server decoding on the static step, the path it takes on a GPU, here on the CPU.

On CUDA our rollout server decodes every turn on the static step (:mod:`spader_pipeline.modeling.graph_decode`:
a static key/value cache, sampled on the device, captured per bucket) while verl's loop moves new weights
into it after every update and, with ``free_cache_engine``, puts it to sleep and wakes it around the
actor's update. ``SPADER_STATIC_DECODE=on`` selects that step on the CPU (launched op by op: graphs are
CUDA's), so verl's real loop drives it here as it will on the lent GPU, where a failure costs a lease:
GRPO, world size 1, 2 steps, verl's own workers and weight sync (as ``test_verl_real_workers.py``).

What it shows: the server decoded its turns on the static step (buckets built, steps launched); the weights
verl sent at each step reached that step, not only the model (the server's log-probabilities, sampled on
the static step, equal those verl's actor recomputes, within the same fp32 bound as the host loop's; a
step decoding from stale weight copies would be O(0.1) off).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

# this folder is on sys.path (pytest's rootdir-relative import of a module outside a package)
import verl_loop_support as loop  # noqa: E402

pytestmark = [pytest.mark.verl_workers, pytest.mark.slow, pytest.mark.e2e]

STEPS = 2
#: as ``test_verl_real_workers.PROBS_DIFF_BOUND``: fp32 on both sides, the static step's sums those of the
#: model's own forward up to their order
PROBS_DIFF_BOUND = 1e-5


@pytest.fixture(scope="module")
def static_run(workspace, tmp_path_factory):
    from spader_pipeline.verl_plugin.decoder_rollout import server_actor_name

    run_dir = tmp_path_factory.mktemp("run-static")
    config = loop.compose_config(loop.method_block("grpo"), workspace, run_dir, steps=STEPS, n_gpus_per_node=1,
                                 overrides=loop.REAL_WORKER_OVERRIDES)
    servers: list[dict] = []
    # the environment Ray's processes inherit: the server's process reads the switch at import
    with loop.local_ray(gpus=1, cpu_platform=True, env={"SPADER_STATIC_DECODE": "on"}):
        start = time.perf_counter()
        metrics = loop.run_fit(config, run_dir, before_cleanup=lambda: servers.append(
            ray.get(ray.get_actor(server_actor_name(0)).stats.remote())))
        loop.print_timing("grpo: fit() with the server on the static step", time.perf_counter() - start)
    return {"metrics": metrics, "server": servers[0]}


def test_the_server_decodes_every_turn_on_the_static_step(static_run):
    server = static_run["server"]
    decoding = server["decoding"]
    print("static step:", decoding, "| server:", {k: server[k] for k in ("batches", "decode_steps", "prefill_seconds",
                                                                        "decoding_seconds", "model_seconds")})
    assert [m["step"] for m in static_run["metrics"]] == [0, 1, 2]  # validation, then 2 steps
    assert server["requests"] > 0 and server["decode_steps"] > 0
    # every decoding step on the static step, op by op on the CPU (no graphs): a turn's first token comes from
    # its prefill's logits, each later one from a step
    assert decoding["buckets"] > 0 and decoding["eager_steps"] >= server["decode_steps"] - server["batches"] > 0
    assert decoding["replays"] == 0 and decoding["captures"] == 0


def test_each_steps_weights_reach_the_static_step(static_run):
    server = static_run["server"]
    updates = server["weight_updates"]
    assert [u["global_steps"] for u in updates] == list(range(STEPS + 1)), updates  # the start, each step
    checksums = [u["checksum"] for u in updates]
    assert all(a != b for a, b in zip(checksums, checksums[1:], strict=False)), checksums
    for data in (m["data"] for m in static_run["metrics"][1:]):
        assert data["training/rollout_probs_diff_valid"] == 1
        assert data["training/rollout_probs_diff_max"] < PROBS_DIFF_BOUND, data["training/rollout_probs_diff_max"]
