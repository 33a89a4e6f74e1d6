"""The ``spader`` reward manager and the ``spa`` estimator on a realistic verl ``DataProto`` batch.

Groups of 16 trajectories with several tool rounds and padding, real (tiny, locally trained) BPE
tokenizer, the real reward-loop manager (``run_single`` per sample, batch assembly), and verl's own
``ray_trainer.compute_advantage(..., adv_estimator="spa")``; the numbers are checked against an
independent slow computation written from the trajectory specification (not from the tokens).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "algorithms"))

from omegaconf import OmegaConf  # noqa: E402
from reference_loops import loop_spa, loop_spader_rewards  # noqa: E402
from tokenizers import ByteLevelBPETokenizer  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

import spader_pipeline.verl_plugin  # noqa: E402,F401  (registers spa/calibadv/tspo and 'spader')
from spader_pipeline.agent.protocol import format_observation  # noqa: E402
from spader_pipeline.algorithms.advantages import grpo_outcome_advantage  # noqa: E402
from spader_pipeline.algorithms.matching import score_answers  # noqa: E402
from spader_pipeline.verl_plugin.batch_reward import assemble_group_rewards  # noqa: E402
from spader_pipeline.verl_plugin.reward_manager import PAYLOAD_KEY, SpaderRewardManager  # noqa: E402

GROUPS = {
    "p0": [["The Beatles", "Beatles"], ["Queen"], ["Pink Floyd"], ["Entity B"]],
    "p1": [["Ghana"], ["Nigeria", "Federal Republic of Nigeria"], ["Togo"]],
}
DOCS = {
    "p0": [
        ("The Beatles", "English rock band formed in Liverpool in 1960."),
        ("Queen", "British rock band formed in London in 1970."),
        ("Entity Beatles", "A fictional tribute act."),  # contains "entity b" only as a prefix
        ("Rock music", "Genre of popular music that originated as rock and roll."),
        ("Pink Floyd", "English rock band formed in London in 1965."),
        ("Liverpool", "City in north west England."),
    ],
    "p1": [
        ("Ghana", "Country in West Africa."),
        ("Federal Republic of Nigeria", "Country in West Africa, most populous in Africa."),
        ("Lomé", "Capital of a small coastal country."),
        ("West Africa", "Region of Africa."),
        ("Sahel", "Ecoclimatic zone south of the Sahara."),
    ],
}
CHAT_OPEN = "<|im_end|>\n<|im_start|>user\n"
CHAT_CLOSE = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Traj:
    uid: str
    turns: list[str]  # model turns
    observations: list[list[tuple[str, str]] | None]  # documents after each turn (None: no observation)
    queries: list[int]  # executed queries per turn


def _make_trajectories(seed: int = 0) -> list[Traj]:
    rng = random.Random(seed)
    trajs = []
    for uid in GROUPS:
        names = [e[0] for e in GROUPS[uid]]
        for k in range(16):
            n_search = rng.randint(0, 3)
            turns, obs, queries = [], [], []
            for _ in range(n_search):
                qs = [rng.choice(names + ["rock bands", "west africa"]) for _ in range(rng.randint(1, 2))]
                turns.append(f"<think>search {k}</think><tool_call>{json.dumps(qs)}</tool_call>")
                obs.append(rng.sample(DOCS[uid], rng.randint(1, 3)))
                queries.append(len(qs))
            style = k % 5
            if style == 4:
                turns.append("<think>unsure</think>I think it is Queen.")  # format error
            else:
                picks = rng.sample(names + ["Foo"], rng.randint(0, 3))
                turns.append(f"<think>done</think><answer>{json.dumps(picks)}</answer>")
            obs.append(None)
            queries.append(0)
            trajs.append(Traj(uid, turns, obs, queries))
    # the reference's reward hack: name entities in the query, retrieve documents without them
    trajs[1] = Traj(
        "p0",
        [
            '<think>guess</think><tool_call>["Queen Pink Floyd The Beatles"]</tool_call>',
            '<answer>["Queen"]</answer>',
        ],
        [[DOCS["p0"][3]], None],
        [1, 0],
    )
    return trajs


def _tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=600, min_frequency=1, special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>")


def _obs_text(docs):
    results = [{"documents": [{"title": t, "contents": c} for t, c in docs]}]
    return CHAT_OPEN + format_observation(results) + CHAT_CLOSE


def _build_batch(trajs: list[Traj], global_step: int):
    texts = [t for tr in trajs for t in tr.turns] + [
        _obs_text(d) for tr in trajs for d in tr.observations if d
    ]
    tok = _tokenizer(texts + ["Answer the question."])
    prompt_len, resp_len = 16, 1536
    prompts, responses, masks, attn = [], [], [], []
    for tr in trajs:
        ids, mask = [], []
        for turn, docs in zip(tr.turns, tr.observations, strict=True):
            t_ids = tok.encode(turn)
            ids += t_ids
            mask += [1] * len(t_ids)
            if docs:
                o_ids = tok.encode(_obs_text(docs))
                ids += o_ids
                mask += [0] * len(o_ids)
        assert len(ids) <= resp_len
        pad = resp_len - len(ids)
        p_ids = tok.encode("Answer the question.")
        prompts.append([tok.pad_token_id] * (prompt_len - len(p_ids)) + p_ids)
        responses.append(ids + [tok.pad_token_id] * pad)
        masks.append(mask + [0] * pad)
        attn.append([0] * (prompt_len - len(p_ids)) + [1] * len(p_ids) + [1] * len(ids) + [0] * pad)
    batch = {
        "prompts": torch.tensor(prompts),
        "responses": torch.tensor(responses),
        "response_mask": torch.tensor(masks),
        "attention_mask": torch.tensor(attn),
    }
    batch["input_ids"] = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    non_tensor = {
        "uid": np.array([tr.uid for tr in trajs], dtype=object),
        "reward_model": np.array([{"ground_truth": GROUPS[tr.uid]} for tr in trajs], dtype=object),
        "data_source": np.array(["embedded"] * len(trajs), dtype=object),
    }
    return tok, DataProto.from_dict(
        tensors=batch, non_tensors=non_tensor, meta_info={"global_steps": global_step}
    )


def _run_manager(tok, data: DataProto, reward_kwargs: dict) -> list[dict]:
    config = OmegaConf.create({"reward": {"reward_kwargs": reward_kwargs}})

    async def main():
        manager = SpaderRewardManager(config, tok)
        return [await manager.run_single(data[i : i + 1]) for i in range(len(data))]

    return asyncio.run(main())


SPADER_KWARGS = {"method": "spader", "format_penalty": 1.0}


def _configure(reward_kwargs: dict) -> None:
    """Class-level settings used by the batch assembly (the manager does this from the trainer config)."""
    SpaderRewardManager.configure(OmegaConf.create({"reward": {"reward_kwargs": reward_kwargs}}))


def _streamed_output(data: DataProto, outputs: list[dict], reward_kwargs: dict = SPADER_KWARGS) -> DataProto:
    """What verl's streaming path hands over, re-assembled by the group reward assembly."""
    gen_in, gen_out = _streamed_pair(data, outputs, reward_kwargs)
    return assemble_group_rewards(get_reward_manager_cls("spader"), gen_in, gen_out)


def _streamed_pair(data: DataProto, outputs: list[dict], reward_kwargs: dict = SPADER_KWARGS):
    """(generation input, output) of verl's streaming path: scalars on the last valid token, extras per sample."""
    _configure(reward_kwargs)
    bsz = len(data)
    prompt_len = data.batch["prompts"].shape[1]
    last = data.batch["attention_mask"][:, prompt_len:].sum(dim=1) - 1
    rm = torch.zeros(data.batch["responses"].shape)
    rm[torch.arange(bsz), last] = torch.tensor([o["reward_score"] for o in outputs], dtype=torch.float32)
    extra = {
        k: np.array([o["reward_extra_info"][k] for o in outputs], dtype=object)
        for k in outputs[0]["reward_extra_info"]
    }
    gen_out = DataProto.from_dict(
        tensors={k: data.batch[k] for k in ("prompts", "responses", "response_mask", "attention_mask")}
        | {"rm_scores": rm},
        non_tensors=extra,
        meta_info={"reward_extra_keys": list(extra)},
    )
    gen_in = DataProto.from_dict(
        tensors={"input_ids": data.batch["prompts"]},
        non_tensors={k: data.non_tensor_batch[k] for k in ("uid", "reward_model", "data_source")},
        meta_info=dict(data.meta_info),
    )
    return gen_in, gen_out


def _expected(trajs: list[Traj], global_step: int, response_mask: torch.Tensor, format_penalty: float):
    docs_text = [["\n".join(f"{t}) {c}" for t, c in d) if d else "" for d in tr.observations] for tr in trajs]
    f1, ok = [], []
    for tr in trajs:
        final = tr.turns[-1]
        is_ok = "<answer>" in final
        picks = json.loads(final.split("<answer>")[1].split("</answer>")[0]) if is_ok else None
        ok.append(is_ok)
        f1.append(score_answers(picks, GROUPS[tr.uid]).f1 if is_ok else 0.0)
    return loop_spader_rewards(
        response_mask,
        [tr.uid for tr in trajs],
        [GROUPS[tr.uid] for tr in trajs],
        docs_text,
        [tr.queries for tr in trajs],
        f1,
        ok,
        global_step=global_step,
        format_penalty=format_penalty,
    )


@pytest.fixture(scope="module")
def spader_batch():
    trajs = _make_trajectories()
    tok, data = _build_batch(trajs, global_step=250)
    outputs = _run_manager(tok, data, SPADER_KWARGS)
    return trajs, tok, data, outputs


def test_reward_manager_registered_and_estimators_in_verl_registry():
    assert get_reward_manager_cls("spader") is SpaderRewardManager
    for name in ("spa", "calibadv", "tspo"):
        assert get_adv_estimator_fn(name).__module__ == "spader_pipeline.verl_plugin.estimators"


def test_batch_rewards_and_spa_through_verl_match_slow_computation(spader_batch):
    trajs, _, data, outputs = spader_batch
    out = _streamed_output(data, outputs)
    expected = _expected(trajs, 250, data.batch["response_mask"], format_penalty=1.0)
    np.testing.assert_allclose(out.batch["rm_scores"], expected, atol=1e-5)
    assert expected.abs().sum() > 1  # the scenario really pays discoveries

    data.batch["token_level_rewards"] = out.batch["rm_scores"]
    algo = OmegaConf.create(
        {"gamma": 0.9, "lam": 1.0, "adv_estimator": "spa", "norm_adv_by_std_in_grpo": True}
    )
    result = compute_advantage(data, adv_estimator="spa", gamma=0.9, config=algo)
    adv_ref, ret_ref = loop_spa(
        expected, data.batch["response_mask"], list(data.non_tensor_batch["uid"]), gamma=0.9
    )
    np.testing.assert_allclose(result.batch["advantages"], adv_ref, atol=1e-5)
    np.testing.assert_allclose(result.batch["returns"], ret_ref, atol=1e-5)


def test_defect3_query_text_earns_nothing(spader_batch):
    """Entity names in the model's own query never count; only retrieved documents do."""
    _, _, _, outputs = spader_batch
    payload = json.loads(outputs[1]["reward_extra_info"][PAYLOAD_KEY])
    assert payload["found"] == [[], []] and payload["queries"] == [1, 0]
    # and "entity b" is not discovered inside "Entity Beatles"
    for o in outputs[:16]:
        found = json.loads(o["reward_extra_info"][PAYLOAD_KEY])["found"]
        assert all(3 not in step for step in found)


def test_defect1_global_step_reaches_the_reward(spader_batch):
    trajs, _, data, outputs = spader_batch
    early = DataProto(batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info={"global_steps": 0})
    at_0 = _streamed_output(early, outputs).batch["rm_scores"]
    at_250 = _streamed_output(data, outputs).batch["rm_scores"]
    assert not torch.allclose(at_0, at_250)  # the cost is charged once the warm-up is over
    early.meta_info.pop("global_steps")
    with pytest.raises(ValueError, match="global_steps"):
        _streamed_output(early, outputs)


def test_reward_extra_info_numbers(spader_batch):
    trajs, _, _, outputs = spader_batch
    for tr, o in zip(trajs, outputs, strict=True):
        info = o["reward_extra_info"]
        assert info["num_queries"] == sum(tr.queries)
        assert info["format_error"] == float("<answer>" not in tr.turns[-1])
        assert o["reward_score"] == (-1.0 if info["format_error"] else pytest.approx(info["f1"]))


def test_text_split_fallback_agrees_when_mask_missing(spader_batch):
    trajs, tok, data, outputs = spader_batch
    nomask = DataProto.from_dict(
        tensors={k: data.batch[k] for k in ("prompts", "responses", "attention_mask")},
        non_tensors={k: data.non_tensor_batch[k] for k in ("uid", "reward_model")},
    )
    again = _run_manager(tok, nomask, SPADER_KWARGS)
    for a, b in zip(outputs, again, strict=True):
        pa, pb = (json.loads(o["reward_extra_info"][PAYLOAD_KEY]) for o in (a, b))
        assert (pa.pop("split"), pb.pop("split")) == ("mask", "text")
        assert pa == pb
    # and the assembled rewards are identical
    np.testing.assert_allclose(
        _streamed_output(data, outputs).batch["rm_scores"], _streamed_output(data, again).batch["rm_scores"]
    )


def test_core_grpo_equals_verl_grpo():
    g = torch.Generator().manual_seed(0)
    r = torch.zeros(48, 20)
    r[:, -1] = torch.rand(48, generator=g)
    m = (torch.rand(48, 20, generator=g) < 0.8).float()
    index = np.array([f"u{i // 16}" for i in range(45)] + ["solo", "solo2", "solo3"], dtype=object)
    ours, _ = grpo_outcome_advantage(r, m, index)
    theirs, _ = compute_grpo_outcome_advantage(r.clone(), m, index)
    np.testing.assert_allclose(ours, theirs, atol=1e-6)


# CalibAdv and TSPO through verl: tests/algorithms/test_methods_cross_backend.py (equal to the native
# path for every method) and tests/native/test_native_batch.py (hand-computed values).


def test_group_reward_agent_loop_manager_wraps_generation(spader_batch, monkeypatch):
    """The manager's generate_sequences (sync call, as the trainer does) re-assembles rm_scores.

    Only verl's rollout (``AgentLoopManager.generate_sequences``, GPU servers) is replaced by a stub
    returning what the streaming reward path produces.
    """
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.utils.ray_utils import auto_await

    from spader_pipeline.verl_plugin.batch_reward import GroupRewardAgentLoopManager

    trajs, _, data, outputs = spader_batch
    prompt_len = data.batch["prompts"].shape[1]
    last = data.batch["attention_mask"][:, prompt_len:].sum(dim=1) - 1
    rm = torch.zeros(data.batch["responses"].shape)
    rm[torch.arange(len(data)), last] = torch.tensor(
        [o["reward_score"] for o in outputs], dtype=torch.float32
    )
    extra = {
        k: np.array([o["reward_extra_info"][k] for o in outputs], dtype=object)
        for k in outputs[0]["reward_extra_info"]
    }
    generated = DataProto.from_dict(
        tensors={k: data.batch[k] for k in ("prompts", "responses", "response_mask", "attention_mask")}
        | {"rm_scores": rm},
        non_tensors=extra,
    )

    @auto_await
    async def fake_generate(self, prompts):
        return generated

    monkeypatch.setattr(AgentLoopManager, "generate_sequences", fake_generate)
    _configure(SPADER_KWARGS)
    manager = object.__new__(GroupRewardAgentLoopManager)  # no Ray workers needed for the wrapper
    manager.reward_cls = SpaderRewardManager
    manager.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 16, "val_kwargs": {"n": 1}}}})
    manager.max_error_rate = 0.5
    prompts = DataProto.from_dict(
        tensors={"input_ids": data.batch["prompts"]},
        non_tensors={"uid": data.non_tensor_batch["uid"]},
        meta_info={"global_steps": 250},
    )
    out = manager.generate_sequences(prompts)
    expected = _expected(trajs, 250, data.batch["response_mask"], format_penalty=1.0)
    np.testing.assert_allclose(out.batch["rm_scores"], expected, atol=1e-5)


def test_forged_observation_in_model_text_earns_nothing():
    """Without a mask the text split is used; a model turn that forges a <tool_response> is detected."""
    forged = (
        "<think>x</think><tool_response>\nDoc 1 (Title: Queen) British rock band.\n</tool_response>"
        '<tool_call>["rock"]</tool_call>'
    )
    trajs = [Traj("p0", [forged, '<answer>["Queen"]</answer>'], [[DOCS["p0"][3]], None], [1, 0])] * 2
    tok, data = _build_batch(trajs, global_step=0)
    nomask = DataProto.from_dict(
        tensors={k: data.batch[k] for k in ("prompts", "responses", "attention_mask")},
        non_tensors={k: data.non_tensor_batch[k] for k in ("uid", "reward_model")},
    )
    outputs = _run_manager(tok, nomask, SPADER_KWARGS)
    payload = json.loads(outputs[0]["reward_extra_info"][PAYLOAD_KEY])
    assert payload["split"] == "text" and len(payload["found"]) == 3  # the forged block made an extra step
    rm = _streamed_output(data, outputs).batch["rm_scores"]
    # only the final term (F1 of ["Queen"] = 0.4) remains; the forged "Queen" document pays nothing
    assert rm.sum(dim=1).tolist() == pytest.approx([0.4, 0.4])


def test_padded_validation_rows_do_not_count_in_group_terms(spader_batch):
    """verl pads a validation batch with copies of its first rows (same uid); they must not change
    the group terms (SPADER's novelty counts) of the real rows."""
    from verl.protocol import pad_dataproto_to_divisor

    trajs, _, data, outputs = spader_batch
    reward_cls = get_reward_manager_cls("spader")
    exact = assemble_group_rewards(reward_cls, *_streamed_pair(data, outputs)).batch["rm_scores"]

    def padded(group_size):
        gen_in, gen_out = _streamed_pair(data, outputs)
        gen_in, pad = pad_dataproto_to_divisor(gen_in, 5)  # 32 rows -> 35, as verl's _validate does
        gen_out, _ = pad_dataproto_to_divisor(gen_out, 5)
        assert pad == 3
        return assemble_group_rewards(reward_cls, gen_in, gen_out, group_size).batch["rm_scores"][: len(data)]

    assert not torch.allclose(padded(None), exact)  # counting the copies shifts the novelty weights
    torch.testing.assert_close(padded(16), exact)
