"""In-process Hugging Face generator: batched across trajectories, token level, VERL's token layout.

:class:`HFGenerator` is the agent's :class:`~spader_pipeline.agent.types.Generator` adapter: the
token bookkeeping of each trajectory (prompt, model turns with mask 1, observations with mask 0) is
:class:`spader_pipeline.agent.tokens.TokenLayout`, the same code the VERL agent loop uses; decoding
the next turn is :class:`spader_pipeline.agent.decode_engine.DecodeEngine`'s (cache reuse, shared
prefill, gap closing, blocked prefill, state capture).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from spader_pipeline.agent.decode_engine import DecodeEngine
from spader_pipeline.agent.state_capture import CapturedStates
from spader_pipeline.agent.tokens import TokenLayout, encode_dialogue, make_token_builder
from spader_pipeline.agent.types import GeneratedTurn, Generator, RolloutState, SamplingParams

__all__ = ["HFGenerator", "encode_dialogue", "make_token_builder"]

#: the engine's settings and counters, read (and the settings set) through the generator
_ENGINE_ATTRIBUTES = (
    "model", "tokenizer", "sampling", "micro_batch_size", "reuse_kv_cache", "bf16", "growing_kv_cache",
    "drop_finished_rows", "prefill_block_cost", "return_log_probs", "eos_ids", "pad_id", "gap_share", "capture",
    "generated_tokens", "sampled_rows", "decode_steps", "model_seconds", "kv_reuses", "shared_prefills",
    "shared_prefix_tokens", "gap_compactions", "blocked_prefills", "prefill_seconds", "decoding_seconds",
    "prefill_tokens", "prefill_positions",
)


def _engine_attribute(name: str) -> property:
    return property(lambda self: getattr(self.engine, name), lambda self, value: setattr(self.engine, name, value),
                    doc=f"the engine's ``{name}`` (:class:`~spader_pipeline.agent.decode_engine.DecodeEngine`)")


class HFGenerator(Generator):
    """Generate assistant turns with a ``transformers`` causal LM, all active trajectories in one batch.

    Args:
        model: a causal LM (eval mode is set; its device is used).
        tokenizer: its tokenizer, with a chat template.
        sampling: decoding parameters (``temperature == 0``: greedy).
        max_prompt_tokens: prompts longer than this are left-truncated with a warning (as VERL does).
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template`` (VERL's
            ``data.apply_chat_template_kwargs``, e.g. ``{"enable_thinking": False}``).
        micro_batch_size: most sequences per ``generate`` call (memory bound).
        reuse_kv_cache: keep the KV cache between a batch's turns (a turn encodes only its new
            tokens) and encode a context several rows share (a group's prompt, the template's
            instruction) once. Same outputs up to floating-point reassociation.
        bf16: run generation under bf16 autocast (decide with
            :func:`spader_pipeline.modeling.precision.resolve_bf16`; slower on CPUs without bf16 units).
        growing_kv_cache: keys/values in a :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache`
            (written in place, not copied every token); ``False``: ``DynamicCache``. Same outputs.
        drop_finished_rows: decode with :func:`spader_pipeline.modeling.decode.decode_batch`, which stops
            computing a row when its turn ends, instead of ``model.generate``, which decodes padding for
            it until the longest row ends. Same sampling distribution, same greedy tokens. Models,
            caches (``growing_kv_cache=False``) or generation settings it cannot handle use
            ``generate`` (logged once); ``False``: always ``generate``. With it, a continued turn
            first closes the cache's masked gaps when they are at least ``gap_share`` (0.1) of it.
        prefill_block_cost: ``(min_tokens, overhead_tokens)``: a continued turn's prefill runs in
            blocks of rows of similar length when that costs less than padding every row to the longest
            (:func:`~spader_pipeline.modeling.batching.padding_blocks`; ``decode_batch`` only);
            ``"auto"``: the model's device's cost (a forward costs more on a GPU); ``None``: one
            forward. Same outputs.
        capture_states_from_layer: keep, per trajectory, decoder block ``k``'s output at its tokens
            (:meth:`captured_states`; the native trainer's boundary states, docs/training.md). Needs
            ``drop_finished_rows``; stops, dropping what it kept, when a turn is decoded with ``generate``.
        return_log_probs: each turn carries its tokens' log-probabilities at the sampling temperature
            (``GeneratedTurn.logprobs``; a rollout server reports them). Needs ``drop_finished_rows``:
            a turn decoded with ``generate`` carries none.
    """

    token_level = True
    supports_log_probs = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingParams | None = None,
        *,
        max_prompt_tokens: int = 1024,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        micro_batch_size: int = 32,
        reuse_kv_cache: bool = True,
        bf16: bool = False,
        growing_kv_cache: bool = True,
        drop_finished_rows: bool = True,
        prefill_block_cost: tuple[int, int] | str | None = "auto",
        capture_states_from_layer: int | None = None,
        return_log_probs: bool = False,
    ) -> None:
        self.engine = DecodeEngine(
            model, tokenizer, sampling, micro_batch_size=micro_batch_size, reuse_kv_cache=reuse_kv_cache, bf16=bf16,
            growing_kv_cache=growing_kv_cache, drop_finished_rows=drop_finished_rows,
            prefill_block_cost=prefill_block_cost, capture_states_from_layer=capture_states_from_layer,
            return_log_probs=return_log_probs,
        )
        builder = make_token_builder(tokenizer, getattr(model.config, "model_type", None), chat_template_kwargs)
        self.layout = TokenLayout(builder, max_prompt_tokens)

    # ---- token bookkeeping (VERL layout) ------------------------------------------------------

    def start(self, state: RolloutState) -> None:
        self.layout.start(state)
        self.engine.track(state.uid)

    def captured_states(self) -> list[CapturedStates | None]:
        """Per trajectory, in the order they were started (``run_rollouts``' order), the states captured
        at its leading tokens (``capture_states_from_layer``; ``None``: nothing usable was captured)."""
        return self.engine.captured_states()

    def append_turn(self, state: RolloutState, turn: GeneratedTurn) -> None:
        self.layout.append_turn(state, turn)

    def append_observation(self, state: RolloutState, previous: list[dict[str, str]]) -> bool:
        return self.layout.append_observation(state, previous)

    # ---- generation ----------------------------------------------------------------------------

    async def generate(self, states: Sequence[RolloutState]) -> list[GeneratedTurn]:
        return await asyncio.to_thread(self.engine.generate, list(states))

    async def aclose(self) -> None:
        self.engine.release()  # free the KV cache


for _name in _ENGINE_ATTRIBUTES:
    setattr(HFGenerator, _name, _engine_attribute(_name))
del _name
