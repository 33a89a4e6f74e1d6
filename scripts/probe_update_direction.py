"""Did training move the policy toward the trajectories its reward favours? A check on fixed weights.

A positive control asks whether RL raised the reward; when the answer is "not measurably", this asks
the first-order question beneath it, with none of the trainer's own machinery: samples ``--samples``
fresh trajectories per fitted question from the warm start at the training temperature (draws no run
trained on), then scores each trajectory's log-probability (the sum over its model tokens, logits
divided by the temperature) under the warm start, with a plain fp32 forward of the whole sequence, and
under every trained policy, whose top ``trainable_layers`` blocks run from the warm start's states
below them (the policies share those frozen blocks; checked). For each trained policy it reports

- ``corr``: the correlation between a trajectory's log-probability change and its advantage (its F1
  minus its question's mean F1), both centred per question: > 0 when the policy moved toward the
  trajectories the reward favours, ~0 when its movement ignores the reward;
- ``is_f1``: the policy's expected F1 on the fitted questions estimated from the warm start's samples
  (self-normalised importance weights per question), beside the warm start's own mean, with the
  effective sample size of the weights (small: the estimate rests on a few trajectories).

Run in the project whose ``make positive-control`` (or ``scripts/probe_positive_control_design.py``)
left trained policies::

    PYTHONPATH=src python scripts/probe_update_direction.py --samples 16 \\
        --policies grpo_s0=data/positive_control/06_models/positive_control/seed0/train_grpo/final --out /tmp/dir.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from spader_pipeline.agent.hf_backend import HFGenerator
from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import RolloutConfig, SamplingParams
from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.modeling import load_model_and_tokenizer
from spader_pipeline.modeling.boundary import top_block_states
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.native.batch import build_batch
from spader_pipeline.retrieval.settings import search_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_warm_start_diversity import _context  # noqa: E402


def token_positions(batch, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions whose logits predict row ``row``'s model tokens, and those tokens."""
    columns = batch.response_mask[row].bool().nonzero(as_tuple=True)[0]
    return int(batch.prompt_lengths[row]) + columns - 1, batch.response_ids[row, columns]  # p-1 predicts p


def summed_logprob(model, hidden: torch.Tensor, batch, row: int, temperature: float) -> float:
    """Row ``row``'s summed log-probability of its model tokens from its last hidden states ``[T, H]``."""
    positions, tokens = token_positions(batch, row)
    logp = torch.log_softmax(model.lm_head(hidden[positions]).float() / temperature, dim=-1)
    return float(logp.gather(1, tokens[:, None]).sum())


def warm_logprobs(model, batch, temperature: float, first_block: int) -> tuple[np.ndarray, list[torch.Tensor]]:
    """``[B]`` summed log-probs under the warm start (a plain fp32 forward of each whole sequence,
    no cache, no shared prefix) and each row's input of block ``first_block`` ``[1, T, H]``."""
    totals, boundaries = [], []
    for row in range(batch.input_ids.shape[0]):
        width = int(batch.attention_mask[row].sum())
        with torch.no_grad():
            out = model.model(input_ids=batch.input_ids[row : row + 1, :width], output_hidden_states=True)
        boundaries.append(out.hidden_states[first_block])
        totals.append(summed_logprob(model, out.last_hidden_state[0], batch, row, temperature))
    return np.array(totals), boundaries


def policy_logprobs(policy, batch, boundaries: list[torch.Tensor], temperature: float, first_block: int) -> np.ndarray:
    """``[B]`` summed log-probs under ``policy``, whose blocks below ``first_block`` equal the warm
    start's: its top blocks run from the warm start's states (the boundary's own tests check this equals
    a plain forward)."""
    totals = []
    for row, boundary in enumerate(boundaries):
        width = boundary.shape[1]
        with torch.no_grad():
            hidden = top_block_states(policy, boundary, batch.input_ids[row : row + 1, :width],
                                      batch.attention_mask[row : row + 1, :width], first_block=first_block)
        totals.append(summed_logprob(policy, hidden[0], batch, row, temperature))
    return np.array(totals)


def frozen_blocks_equal(warm, policy, first_block: int) -> bool:
    """Whether ``policy``'s embeddings and blocks below ``first_block`` are the warm start's."""
    trained = {n for n, _ in policy.named_parameters() if any(f"layers.{k}." in n for k in
                                                                range(first_block, policy.config.num_hidden_layers))}
    theirs = dict(warm.named_parameters())
    return all(torch.equal(p, theirs[n]) for n, p in policy.named_parameters()
               if n not in trained and not n.startswith(("model.norm", "lm_head")))


def direction(delta: np.ndarray, f1: np.ndarray, groups: np.ndarray) -> dict[str, float]:
    """Correlation of the per-question-centred log-prob change with the advantage, and the
    self-normalised importance estimate of the policy's mean F1 (mean over questions)."""
    centred_delta, advantage, estimates, ess = np.empty_like(delta), np.empty_like(f1), [], []
    for g in np.unique(groups):
        rows = groups == g
        centred_delta[rows] = delta[rows] - delta[rows].mean()
        advantage[rows] = f1[rows] - f1[rows].mean()
        weights = np.exp(delta[rows] - delta[rows].max())
        weights /= weights.sum()
        estimates.append(float((weights * f1[rows]).sum()))
        ess.append(float(1.0 / (weights**2).sum()))
    corr = float(np.corrcoef(centred_delta, advantage)[0, 1]) if advantage.std() > 0 else float("nan")
    return {"corr": round(corr, 3), "is_f1": round(float(np.mean(estimates)), 4),
            "ess_per_question": round(float(np.mean(ess)), 1),
            "mean_abs_delta": round(float(np.abs(centred_delta).mean()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="positive_control")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seed", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--policies", nargs="+", required=True, help="name=path of each trained policy")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = _context(args.env)
    params, catalog = context.params, context.catalog
    native = params["training"]["native"]
    temperature = float(native["temperature"])
    fitted = samples_from_verl(catalog.load("fitted_train"))
    rollout = RolloutConfig.from_mapping(native["rollout"])
    template = resolve_template(params["prompt"])
    warm = catalog.load("warm_start_manifest")["path"]
    started = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(warm, device="cpu")
    model.eval()
    limits = {"max_prompt_tokens": int(native["max_prompt_tokens"]), "bf16": resolve_bf16(native.get("bf16", "auto"),
                                                                                          "cpu", model)}
    trajectories, samples = [], []
    with search_backend(params["training"].get("search"), catalog.load("index_manifest")["index_dir"],
                        where="training.search") as search:
        for k, question in enumerate(fitted):
            generator = HFGenerator(model, tokenizer, SamplingParams(temperature=temperature,
                                                                     max_new_tokens=int(native["max_new_tokens"]),
                                                                     seed=args.seed + k),
                                    micro_batch_size=args.samples, **limits)
            trajectories += run_rollouts_sync([question] * args.samples, generator, search, rollout, template)
            samples += [{**question, "uid": str(question["id"])}] * args.samples
    batch = build_batch(trajectories, samples, tokenizer.pad_token_id)
    f1, groups = batch.rewards.f1.numpy().astype(float), np.asarray(batch.uids)
    print(f"sampled {len(trajectories)} trajectories in {time.perf_counter() - started:.0f} s; "
          f"F1 mean {f1.mean():.3f}", flush=True)
    first_block = model.config.num_hidden_layers - int(native["trainable_layers"])
    base, boundaries = warm_logprobs(model.float(), batch, temperature, first_block)
    print(f"warm start's log-probs in {time.perf_counter() - started:.0f} s", flush=True)
    result = {"samples": args.samples, "seed": args.seed, "temperature": temperature, "warm_f1": round(float(
        np.mean([f1[groups == g].mean() for g in np.unique(groups)])), 4), "policies": {}}
    for name, path in (p.split("=", 1) for p in args.policies):
        policy, _ = load_model_and_tokenizer(path, device="cpu")
        policy = policy.float().eval()
        if not frozen_blocks_equal(model, policy, first_block):
            raise SystemExit(f"{name}: its blocks below {first_block} differ from the warm start's")
        result["policies"][name] = direction(policy_logprobs(policy, batch, boundaries, temperature, first_block) - base,
                                             f1, groups)
        print(name, result["policies"][name], flush=True)
        del policy
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
