"""The rollout engine is a setting: the native trainer and the evaluator build theirs through the registry
(:mod:`spader_pipeline.agent.engines`), and an engine that captures no boundary states still trains (the
update runs the frozen blocks itself)."""

from __future__ import annotations

import pytest
from native_toy import QUESTIONS, TEMPLATE

from spader_pipeline.agent.engines import build_generator, register_engine, unregister_engine
from spader_pipeline.agent.types import CapturesStates, Generator
from spader_pipeline.retrieval.service import LocalSearch


class PlainDecoder(Generator):
    """The in-process decoder behind the plain Generator interface only: it decodes as ``hf`` does, but
    offers no boundary states and keeps no counters."""

    token_level = True

    def __init__(self, model, tokenizer, sampling=None, **options):
        self.inner = build_generator("hf", model, tokenizer, sampling, **options)

    def start(self, state):
        self.inner.start(state)

    async def generate(self, states):
        return await self.inner.generate(states)

    def append_turn(self, state, turn):
        self.inner.append_turn(state, turn)

    def append_observation(self, state, previous):
        return self.inner.append_observation(state, previous)

    async def aclose(self):
        await self.inner.aclose()


@pytest.fixture(scope="module", autouse=True)
def plain():
    register_engine("plain")(PlainDecoder)
    yield "plain"
    unregister_engine("plain")


def test_an_engine_without_state_capture_trains_through_the_frozen_blocks(tmp_path, native_model_dir, toy_index_dir,
                                                                          tiny_config):
    from spader_pipeline.native.trainer import start_run, train_native
    from spader_pipeline.retrieval import load_retriever

    settings = dict(total_steps=1, trainable_layers=1, learning_rate=1e-2, kl_coef=0.0)
    assert start_run(tiny_config(**settings), native_model_dir, tmp_path / "hf").boundary_block == 1
    config = tiny_config(**settings, engine="plain")
    assert not issubclass(PlainDecoder, CapturesStates)
    assert start_run(config, native_model_dir, tmp_path / "probe").boundary_block is None
    result = train_native(config, model_path=native_model_dir, samples=QUESTIONS, run_dir=tmp_path / "plain",
                          search=LocalSearch(load_retriever(toy_index_dir)), prompt_template=TEMPLATE)
    [step] = result.history
    assert step["step"] == 1 and step["perf/reused_rollout_states"] == 0.0
    assert step["perf/generate_tokens_per_second"] > 0  # counted from the trajectories' model tokens


def test_an_evaluated_checkpoint_decodes_with_the_engine_its_entry_names(native_model_dir):
    from spader_pipeline.evaluation.models import ModelSpec, open_generator

    entry = {"name": "tiny", "kind": "hf", "path": str(native_model_dir), "device": "cpu", "bf16": False}
    assert ModelSpec.from_mapping(entry).engine == "hf"
    assert ModelSpec.from_mapping({"name": "m", "kind": "served", "path": "p"}).engine == "vllm"
    with pytest.raises(ValueError, match=r"unknown rollout engine 'nope'; registered: \['hf', 'plain'\]"):
        ModelSpec.from_mapping({**entry, "engine": "nope"})
    with open_generator(ModelSpec.from_mapping({**entry, "engine": "plain"})) as generator:
        assert isinstance(generator, PlainDecoder) and generator.inner.bf16 is False
