"""Both trainers compute the same update: one verl step on its real FSDP actor, and the native trainer's
functions on the batch verl trained on.

verl's ``fit()`` runs one GRPO or SPADER step with its real ``ActorRolloutRefWorker`` (FSDP2 on gloo);
the rollout is the scripted search agent of :mod:`verl_cpu_boundary` (its four plans give a group
different rewards, so the advantages are not all zero). The trainer's ``_update_actor`` is wrapped to
keep the batch it hands the actor (the narrowest boundary: verl's own call goes on unchanged). On that
batch, from the same initial weights, the native trainer's own code computes

* the per-token log-probs of the sampled tokens (:func:`spader_pipeline.native.update.response_logprobs`)
  against verl's ``old_log_probs`` (its actor's ``compute_log_prob``);
* the advantages (:func:`spader_pipeline.native.batch.compute_advantages`, the method registry's
  reward layout and estimator) against verl's (rewards assembled by the ``spader`` reward manager,
  verl's ``compute_advantage`` with the registered estimator);
* the policy loss and the gradient norm of one update (:func:`spader_pipeline.native.update.update_policy`:
  verl's PPO loss and aggregation, KL to the reference) against verl's ``actor/pg_loss`` and
  ``actor/grad_norm``: a different aggregation of the loss (sum instead of token mean, per micro-batch
  instead of per batch) or advantages on the wrong tokens changes both.

Tolerances (fp32 on both sides, one CPU): log-probs :data:`LOGP_ATOL`, advantages :data:`ADV_ATOL`, loss
and gradient norm relative :data:`LOSS_RTOL`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from verl_cpu_boundary import SCRIPTED_ROLLOUT, SERVER_NAME, start_scripted_server  # noqa: E402
from verl_loop_support import (  # noqa: E402
    MAX_MODEL_LEN,
    PROMPT_LENGTH,
    REAL_WORKER_OVERRIDES,
    RESPONSE_LENGTH,
    compose_config,
    local_ray,
    method_block,
    run_fit,
)

pytestmark = [pytest.mark.verl_workers, pytest.mark.slow, pytest.mark.e2e]

LOGP_ATOL = 1e-5
ADV_ATOL = 1e-5
LOSS_RTOL = 1e-4
METHODS = ("grpo", "spader")


@pytest.fixture(scope="module")
def cpu_ray(workspace):
    with local_ray(gpus=1, cpu_platform=True, modules=["verl_cpu_boundary"]):
        start_scripted_server(str(workspace["model"]), PROMPT_LENGTH, RESPONSE_LENGTH, MAX_MODEL_LEN)
        yield


def verl_step(method: str, ws: dict, run_dir: Path, monkeypatch) -> dict:
    """One verl step with the real actor; the batch its actor trained on and the step's metrics."""
    from verl.trainer import main_ppo_v0
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    seen = {}

    class KeepsTheActorsBatch(RayPPOTrainer):
        def _update_actor(self, batch):
            seen["batch"] = copy.deepcopy(batch)
            return super()._update_actor(batch)

    monkeypatch.setattr(main_ppo_v0, "RayPPOTrainer", KeepsTheActorsBatch)
    overrides = [o for o in REAL_WORKER_OVERRIDES if not o.startswith(("actor_rollout_ref.rollout.name=",
                                                                         "actor_rollout_ref.rollout.calculate_log_probs="))]
    overrides += [f"actor_rollout_ref.rollout.name={SCRIPTED_ROLLOUT}",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
    config = compose_config(method_block(method), ws, run_dir, steps=1, overrides=overrides,
                            validation={"every": 0, "before_train": False, "max_questions": None})
    metrics = run_fit(config, run_dir, keep_actors=[SERVER_NAME])
    return {"batch": seen["batch"], "metrics": metrics[-1]["data"], "config": config}


def native_batch(batch, payloads_config):
    """The native trainer's ``RolloutBatch`` of verl's padded batch (prompt left-padded, response
    right-padded) with the reward inputs verl's reward manager built from the same trajectories."""
    from spader_pipeline.native.batch import RolloutBatch
    from spader_pipeline.verl_plugin.reward_manager import (
        ManagerSettings,
        _payloads,
        reward_inputs_from_payloads,
    )

    settings = ManagerSettings.from_config(payloads_config)
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    attention, mask = batch.batch["attention_mask"], batch.batch["response_mask"].float()
    width_p = prompts.shape[1]
    rows = []
    for i in range(len(prompts)):
        prompt = prompts[i][attention[i, :width_p] == 1]
        response = responses[i][: int(attention[i, width_p:].sum())]
        rows.append((prompt, response))
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    att = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(rows):
        input_ids[i, : len(p) + len(r)] = torch.cat([p, r])
        att[i, : len(p) + len(r)] = 1
    step = int(batch.meta_info.get("global_steps", 1))  # the run's one step
    inputs, _, _ = reward_inputs_from_payloads(mask, _payloads(batch, []), step, settings)
    n = len(rows)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=att, prompt_lengths=torch.tensor([len(p) for p, _ in rows]),
        response_ids=responses.clone(), response_mask=mask, uids=np.asarray(batch.non_tensor_batch["uid"], dtype=object),
        ground_truths=[[] for _ in range(n)], rewards=inputs, precision=torch.zeros(n), recall=torch.zeros(n),
        num_turns=torch.zeros(n), num_searches=torch.zeros(n),
    ), settings, step


@pytest.mark.parametrize("method", METHODS)
def test_native_and_verl_compute_the_same_update(method, workspace, cpu_ray, tmp_path, monkeypatch):
    from spader_pipeline.modeling import load_model_and_tokenizer
    from spader_pipeline.native import NativeTrainerConfig
    from spader_pipeline.native.batch import compute_advantages
    from spader_pipeline.native.update import actor_config, response_logprobs, update_policy

    step = verl_step(method, workspace, tmp_path, monkeypatch)
    verl_batch, metrics, config = step["batch"], step["metrics"], step["config"]
    batch, settings, global_step = native_batch(verl_batch, config)
    mask = batch.response_mask.bool()
    assert mask.sum() > 0

    model, _ = load_model_and_tokenizer(workspace["model"])  # the actor's weights before its update
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, slice(None), temperature=1.0, bf16=False, with_entropy=False)
    old = verl_batch.batch["old_log_probs"]
    assert (logp[mask] - old[mask]).abs().max() < LOGP_ATOL, (logp[mask] - old[mask]).abs().max()

    adv = compute_advantages(batch, method, global_step=global_step, reward=settings.reward, options=settings.options)
    verl_adv = verl_batch.batch["advantages"]
    assert verl_adv[mask].abs().sum() > 0, "no learning signal in the batch"
    torch.testing.assert_close(adv.advantages * mask, verl_adv * mask, atol=ADV_ATOL, rtol=0)

    actor = config.actor_rollout_ref.actor
    native = NativeTrainerConfig(
        method=method, group_size=int(config.actor_rollout_ref.rollout.n), prompts_per_step=int(config.data.train_batch_size),
        micro_batch_size=4, learning_rate=float(actor.optim.lr), weight_decay=float(actor.optim.weight_decay),
        max_grad_norm=float(actor.grad_clip), clip_ratio_low=float(actor.clip_ratio_low),
        clip_ratio_high=float(actor.clip_ratio_high), clip_ratio_c=float(actor.clip_ratio_c),
        loss_agg_mode=str(actor.loss_agg_mode), kl_coef=float(actor.kl_loss_coef), kl_type=str(actor.kl_loss_type),
        bf16=False,
    )
    reference = copy.deepcopy(model).eval()
    trainable = list(model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=native.learning_rate, weight_decay=native.weight_decay)
    stats = update_policy(model, reference, optimizer, trainable, batch, adv, native, actor_config(native),
                          bf16=False, step=global_step)
    print(f"{method}: log-probs max gap {(logp[mask] - old[mask]).abs().max():.2e}; advantages max gap "
          f"{(adv.advantages - verl_adv)[mask].abs().max():.2e}; pg_loss {stats.sums['policy']:.6g} (verl "
          f"{metrics['actor/pg_loss']:.6g}); grad_norm {stats.grad_norm:.6g} (verl {metrics['actor/grad_norm']:.6g})",
          file=sys.stderr)
    assert stats.sums["policy"] == pytest.approx(metrics["actor/pg_loss"], rel=LOSS_RTOL, abs=1e-7)
    assert stats.grad_norm == pytest.approx(metrics["actor/grad_norm"], rel=LOSS_RTOL)
