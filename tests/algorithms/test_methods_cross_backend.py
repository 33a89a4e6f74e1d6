"""One method, one definition: the native trainer and the VERL plugin give identical token rewards and
advantages, for every registered method, on the same trajectories.

The same scripted trajectories (groups with several tool rounds, format errors, partial answers,
repeated searches) are laid out twice:

* native: ``agent.rollout.Trajectory`` objects → :func:`spader_pipeline.native.batch.build_batch` →
  :func:`~spader_pipeline.native.batch.compute_advantages`, configured from the Kedro parameters
  (``training.reward`` + ``train_<method>.method``);
* VERL: token ids decoded by a real (tiny, locally trained) BPE tokenizer → the ``spader`` reward
  manager (``run_single`` per sample, whole-batch assembly as ``GroupRewardAgentLoopManager`` calls it)
  → verl's own ``ray_trainer.compute_advantage`` with the estimator registered under the method's
  name, configured from the composed Hydra config ``conf/base/verl/method.yaml`` with ``spader_method=<method>``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402
from kedro.config import OmegaConfigLoader  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tokenizers import ByteLevelBPETokenizer  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

import spader_pipeline.verl_plugin  # noqa: E402,F401  (registers the estimators and the manager)
from spader_pipeline.agent.protocol import format_observation, parse_turn  # noqa: E402
from spader_pipeline.agent.types import Step, Trajectory  # noqa: E402
from spader_pipeline.algorithms.methods import (  # noqa: E402
    get_method,
    method_names,
    options_from_mapping,
    reward_config_from_mapping,
)
from spader_pipeline.native.batch import build_batch, compute_advantages  # noqa: E402
from spader_pipeline.verl_plugin.batch_reward import assemble_group_rewards  # noqa: E402
from spader_pipeline.verl_plugin.reward_manager import SpaderRewardManager  # noqa: E402
from spader_pipeline.verl_plugin.trajectory import documents_in_observation  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GROUND_TRUTH = {
    "p0": [["The Beatles", "Beatles"], ["Queen"], ["Pink Floyd"]],
    "p1": [["Ghana"], ["Nigeria", "Federal Republic of Nigeria"], ["Togo"]],
}
DOCS = {
    "p0": [("The Beatles", "English rock band from Liverpool."), ("Queen", "British rock band from London."),
           ("Pink Floyd", "English rock band formed in 1965."), ("Rock music", "A genre of popular music.")],
    "p1": [("Ghana", "Country in West Africa."), ("Federal Republic of Nigeria", "Most populous in Africa."),
           ("Lomé", "Capital of Togo."), ("Sahel", "Zone south of the Sahara.")],
}
OPEN, CLOSE = "<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
GLOBAL_STEP = 250  # past the free and ramp-up steps: the tool cost is fully on


def _scripts(seed: int = 0) -> list[tuple[str, list[str], list[list[tuple[str, str]] | None]]]:
    """(uid, model turns, documents after each turn) for two groups of 8."""
    rng = random.Random(seed)
    out = []
    for uid, names in (("p0", ["The Beatles", "Queen", "Pink Floyd"]), ("p1", ["Ghana", "Nigeria", "Togo"])):
        for k in range(8):
            turns, docs = [], []
            thought = "search for more" if k % 3 == 0 else f"look up item {k}"
            for _ in range(rng.randint(0, 3)):
                queries = rng.sample(names + ["rock", "west africa"], rng.randint(1, 2))
                turns.append(f"<think>{thought}</think><tool_call>{json.dumps(queries)}</tool_call>")
                docs.append(rng.sample(DOCS[uid], rng.randint(1, 3)))
            if k % 4 == 3:
                turns.append("<think>unsure</think>It is Queen.")  # format error
            else:
                picks = names if k == 0 else rng.sample(names + ["Foo"], rng.randint(0, 3))
                turns.append(f"<think>done</think><answer>{json.dumps(picks)}</answer>")
            docs.append(None)
            out.append((uid, turns, docs))
    return out


def _observation(docs) -> str:
    return OPEN + format_observation([{"documents": [{"title": t, "contents": c} for t, c in docs]}]) + CLOSE


@pytest.fixture(scope="module")
def scripted():
    scripts = _scripts()
    texts = [t for _, turns, _ in scripts for t in turns] + [_observation(d) for *_, ds in scripts for d in ds if d]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts + ["Answer."], vocab_size=500, min_frequency=1,
                            special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>")
    prompt = tok.encode("Answer.")
    trajectories, samples = [], []
    for uid, turns, docs in scripts:
        response, mask, steps = [], [], []
        for k, (turn, found) in enumerate(zip(turns, docs, strict=True)):
            ids = tok.encode(turn)
            response += ids
            mask += [1] * len(ids)
            parsed = parse_turn(turn)
            lines = documents_in_observation(_observation(found)) if found else []
            steps.append(Step(turn=k + 1, text=turn, kind=parsed.kind, queries=parsed.queries if found else (),
                              answers=parsed.answers, doc_ids=[lines] if found else [], retrieved_texts=lines))
            if found:
                obs = tok.encode(_observation(found))
                response += obs
                mask += [0] * len(obs)
        final = parse_turn(turns[-1])
        trajectories.append(Trajectory(
            id=uid, question="q", messages=[], steps=steps, finish_reason="answer",
            predicted=final.answers if final.kind == "answer" else None,
            prompt_ids=prompt, response_ids=response, response_mask=mask,
        ))
        samples.append({"uid": uid, "ground_truth": GROUND_TRUTH[uid]})
    return tok, trajectories, samples


def _data_proto(tok, trajectories, samples) -> DataProto:
    """What verl's agent loop hands over: left-padded prompts, right-padded responses and masks."""
    width = max(len(t.response_ids) for t in trajectories) + 5
    plen = len(trajectories[0].prompt_ids)
    pad = tok.pad_token_id
    responses = torch.tensor([t.response_ids + [pad] * (width - len(t.response_ids)) for t in trajectories])
    masks = torch.tensor([t.response_mask + [0] * (width - len(t.response_mask)) for t in trajectories])
    attention = torch.cat([torch.ones((len(trajectories), plen), dtype=torch.long), (responses != pad).long()], 1)
    attention[:, plen:] = torch.tensor([[1] * len(t.response_ids) + [0] * (width - len(t.response_ids))
                                        for t in trajectories])
    prompts = torch.tensor([t.prompt_ids for t in trajectories])
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": masks, "attention_mask": attention,
                 "input_ids": torch.cat([prompts, responses], 1)},
        non_tensors={"uid": np.array([s["uid"] for s in samples], dtype=object),
                     "reward_model": np.array([{"ground_truth": s["ground_truth"]} for s in samples], dtype=object),
                     "data_source": np.array(["embedded"] * len(samples), dtype=object)},
        meta_info={"global_steps": GLOBAL_STEP},
    )


@functools.cache
def _composed(method: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "base" / "verl"), version_base=None):
        return compose(config_name="method", overrides=[f"spader_method={method}"])


def _verl_config(method: str, updates: dict[str, object]):
    """The method's overlay composed on verl's ppo_trainer (once per method), with ``updates``."""
    config = copy.deepcopy(_composed(method))
    for key, value in updates.items():
        OmegaConf.update(config, key, value)
    return config


def _verl_path(tok, data: DataProto, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward manager per sample, batch assembly, then verl's compute_advantage."""

    async def score():
        manager = SpaderRewardManager(config, tok)
        return [await manager.run_single(data[i : i + 1]) for i in range(len(data))]

    outputs = asyncio.run(score())
    SpaderRewardManager.configure(config)  # what GroupRewardAgentLoopManager does with the trainer config
    plen = data.batch["prompts"].shape[1]
    last = data.batch["attention_mask"][:, plen:].sum(dim=1) - 1
    streamed = torch.zeros(data.batch["responses"].shape)
    streamed[torch.arange(len(data)), last] = torch.tensor([o["reward_score"] for o in outputs])
    extra = {k: np.array([o["reward_extra_info"][k] for o in outputs], dtype=object)
             for k in outputs[0]["reward_extra_info"]}
    generated = DataProto.from_dict(
        tensors={k: data.batch[k] for k in ("prompts", "responses", "response_mask", "attention_mask")}
        | {"rm_scores": streamed},
        non_tensors=extra,
    )
    prompts = DataProto.from_dict(tensors={"input_ids": data.batch["prompts"]},
                                  non_tensors={k: data.non_tensor_batch[k] for k in ("uid", "reward_model")},
                                  meta_info=dict(data.meta_info))
    rewards = assemble_group_rewards(get_reward_manager_cls("spader"), prompts, generated).batch["rm_scores"]
    batch = DataProto(batch=data.batch.clone(), non_tensor_batch=dict(data.non_tensor_batch), meta_info={})
    batch.batch["token_level_rewards"] = rewards
    algorithm = config.algorithm
    out = compute_advantage(batch, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
                            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm)
    return rewards, out.batch["advantages"]


@pytest.fixture(scope="module")
def kedro_params():
    return OmegaConfigLoader(str(ROOT / "conf"), base_env="base", default_run_env="base")["parameters"]


# the paper configurations, and one where every method pays a tool cost (its outcome-level form)
SETTINGS = {"paper": ({}, {}), "cost": ({"tool_round_cost": 0.05}, {"reward.reward_kwargs.tool_round_cost": 0.05})}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("method", method_names())
def test_native_and_verl_give_identical_token_rewards_and_advantages(scripted, kedro_params, method, setting):
    tok, trajectories, samples = scripted
    kedro_reward, verl_updates = SETTINGS[setting]
    block = kedro_params[f"train_{method}"]["method"]
    reward = reward_config_from_mapping(method, {**kedro_params["training"]["reward"], **block["reward"],
                                                 **kedro_reward})
    options = options_from_mapping(method, block.get("options"))
    native_batch = build_batch(trajectories, samples, pad_id=tok.pad_token_id)
    native = compute_advantages(native_batch, method, global_step=GLOBAL_STEP, reward=reward, options=options)

    config = _verl_config(method, verl_updates)
    assert config.algorithm.adv_estimator == get_method(method).estimator
    rewards, advantages = _verl_path(tok, _data_proto(tok, trajectories, samples), config)

    width = native.token_rewards.shape[1]
    assert rewards[:, width:].abs().sum() == 0 and advantages[:, width:].abs().sum() == 0
    torch.testing.assert_close(rewards[:, :width].float(), native.token_rewards.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(advantages[:, :width].float(), native.advantages.float(), atol=1e-5, rtol=1e-4)
    # the scenario is not degenerate: rewards and advantages vary, tool costs are charged where configured
    assert native.advantages.abs().sum() > 1 and native.token_rewards.abs().sum() > 1
    assert (native.cost_coefficient > 0) == (reward.tool_round_cost > 0)


@pytest.mark.parametrize("method", method_names())
def test_verl_overlay_and_kedro_method_block_define_the_same_method(kedro_params, method):
    """Design: one name per setting; the VERL values equal the Kedro block (Qwen3 schedule)."""
    from spader_pipeline.verl_plugin.reward_manager import ManagerSettings

    block = kedro_params[f"train_{method}"]["method"]
    kedro_reward = reward_config_from_mapping(method, {**kedro_params["training"]["reward"], **block["reward"]})
    verl = ManagerSettings.from_config(_verl_config(method, {}))
    assert verl.method == method
    assert verl.reward == kedro_reward
    assert verl.options == options_from_mapping(method, block.get("options"))
