"""Rollout engines by name (:mod:`spader_pipeline.agent.engines`): a second engine registered beside
``hf`` is built by name and driven by the agent loop, an unknown name lists the registered ones, and an
option that asks for a capability the engine lacks (boundary states, log-probabilities) is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spader_pipeline.agent.engines import (
    DEFAULT_ENGINE,
    ENGINES,
    build_generator,
    captures_states,
    register_engine,
    unregister_engine,
)
from spader_pipeline.agent.rollout import run_rollouts_sync
from spader_pipeline.agent.types import (
    CapturesStates,
    GeneratedTurn,
    Generator,
    RolloutConfig,
    SamplingParams,
)
from spader_pipeline.typed_config import SettingsError


class EchoGenerator(Generator):
    """A model-free engine: every turn answers ``echo`` at once. It keeps no states and no log-probs."""

    def __init__(self, model, tokenizer, sampling=None, **options):
        self.model, self.sampling, self.options = model, sampling, options

    async def generate(self, states):
        return [GeneratedTurn(text='<answer>["echo"]</answer>') for _ in states]


@pytest.fixture
def echo():
    register_engine("echo")(EchoGenerator)
    yield "echo"
    unregister_engine("echo")


def test_a_registered_engine_is_built_by_name_or_from_settings_and_the_loop_drives_it(echo):
    sampling = SamplingParams(temperature=0.0)
    generator = build_generator("echo", "a model", None, sampling, micro_batch_size=4, capture_states_from_layer=None,
                                return_log_probs=False)
    assert isinstance(generator, EchoGenerator) and generator.model == "a model" and generator.sampling == sampling
    assert generator.options == {"micro_batch_size": 4}  # capabilities asked for by no one are not passed on
    assert isinstance(build_generator(SimpleNamespace(engine="echo"), None, None), EchoGenerator)
    [trajectory] = run_rollouts_sync([{"id": "q", "question": "Which?"}], generator, None, RolloutConfig(), "{question}")
    assert trajectory.predicted == ("echo",) and trajectory.finish_reason == "answer"
    with pytest.raises(ValueError, match="'echo' is already registered"):
        register_engine("echo")(EchoGenerator)


def test_an_unknown_engine_lists_the_registered_ones(echo):
    from spader_pipeline.native import NativeTrainerConfig

    message = r"unknown rollout engine 'nope'; registered: \['echo', 'hf'\]"
    with pytest.raises(SettingsError, match=message):
        build_generator("nope", None, None)
    with pytest.raises(SettingsError, match=message):
        NativeTrainerConfig(engine="nope")
    assert NativeTrainerConfig(engine="echo").engine == "echo" and NativeTrainerConfig().engine == DEFAULT_ENGINE


def test_an_engine_is_asked_only_for_the_capabilities_it_has(echo):
    from spader_pipeline.agent.hf_backend import HFGenerator

    assert captures_states("hf") and issubclass(HFGenerator, CapturesStates) and HFGenerator.supports_log_probs
    assert not captures_states("echo") and not EchoGenerator.supports_log_probs
    with pytest.raises(SettingsError, match="'echo' captures no states"):
        build_generator("echo", None, None, capture_states_from_layer=0)
    with pytest.raises(SettingsError, match="'echo' returns no log-probabilities"):
        build_generator("echo", None, None, return_log_probs=True)
    assert set(ENGINES) == {"echo", DEFAULT_ENGINE}
