"""VERL's token layout for multi-turn trajectories, shared by the HF backend and the VERL agent loop.

Layout (VERL 0.9 agent loop, ``verl.experimental.agent_loop``):

* ``prompt_ids`` = the chat template applied to the prompt messages with
  ``add_generation_prompt=True``;
* each assistant turn appends the generated ids as sampled (mask 1), end-of-turn token included;
* each observation (a ``user`` message) is encoded by VERL's own Continuous-Token builder
  (``create_continuous_token_builder``): the template is rendered after a synthetic system+user
  prefix with ``add_generation_prompt=True`` and the prefix is cut off, plus the model family's
  boundary fix (Qwen: the ``"\\n"`` after a generated ``<|im_end|>``). These tokens get mask 0
  (and log-prob 0.0 when log-probs are tracked).

Calling the builder itself, rather than re-implementing it, guarantees that the native trainer and
VERL see the same tokens. The builder renders each observation after the same synthetic prefix and
renders that prefix again to cut it off, so the prefix's tokens, a group's shared prompt and the
observations a group's searches repeat are each rendered once (:func:`memoize_renders`): the builder's
render is a function of the messages alone, so its tokens are the same. At the one-GPU run's shape (768
trajectories a step, ~3,900 turns) the rollout's work outside the model took ~3 s a step, two thirds
of it in these renders (docs/performance.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from spader_pipeline.agent.types import GeneratedTurn, RolloutState
from spader_pipeline.modeling.warm_start import SFTExample, example_from_tokens

logger = logging.getLogger(__name__)

__all__ = ["RENDER_MEMO_SIZE", "TokenLayout", "encode_dialogue", "examples_from_dialogues", "make_token_builder",
           "memoize_renders", "pad_batch"]

#: renders a builder keeps (:func:`memoize_renders`); when full it starts over. A step of 768 trajectories
#: renders ~3,000 distinct observations; each kept render is its token ids as 8-byte integers
RENDER_MEMO_SIZE = 4096


def make_token_builder(
    tokenizer: Any, model_type: str | None, chat_template_kwargs: Mapping[str, Any] | None = None
):
    """VERL's Continuous-Token builder for this tokenizer and model family."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    return memoize_renders(create_continuous_token_builder(
        tokenizer, hf_model_type=model_type, chat_template_kwargs=dict(chat_template_kwargs or {})
    ))


def _render_key(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, tools: Any) -> tuple | None:
    """A hashable key of one render's arguments, or ``None`` where one is not hashable (list content, tools)."""
    if tools is not None:
        return None
    try:
        key = (bool(add_generation_prompt), tuple(tuple(sorted(m.items())) for m in messages))
        hash(key)
    except TypeError:
        return None
    return key


def memoize_renders(builder: Any, size: int = RENDER_MEMO_SIZE) -> Any:
    """``builder`` (a VERL Continuous-Token builder) with its chat-template render (``_render_tokens``: the
    messages, the generation prompt, the tools → token ids, a function of them alone) kept per distinct
    messages, at most ``size`` of them. Every render the builder makes goes through it: an observation's
    render after the synthetic prefix, the prefix's own, a prompt's. Renders of unhashable messages (list
    content) or with tools go through uncached. Returns ``builder``, changed in place."""
    from array import array

    render = builder._render_tokens
    kept: dict[tuple, array] = {}

    def cached(messages: list[dict[str, Any]], *, add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        key = _render_key(messages, add_generation_prompt, tools)
        if key is None:
            return render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        ids = kept.get(key)
        if ids is None:
            if len(kept) >= size:
                kept.clear()
            ids = kept[key] = array("q", render(messages, add_generation_prompt=add_generation_prompt, tools=tools))
        return ids.tolist()

    builder._render_tokens = cached
    return builder


class TokenLayout:
    """Keeps ``state.token_ids`` / ``response_mask`` / ``response_logprobs`` in VERL's layout."""

    def __init__(self, builder: Any, max_prompt_tokens: int | None = None) -> None:
        self.builder = builder
        self.max_prompt_tokens = max_prompt_tokens

    def start(self, state: RolloutState) -> None:
        ids = list(self.builder.build_initial_tokens(state.messages))
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            logger.warning(
                "prompt of %d tokens exceeds %d; left-truncating", len(ids), self.max_prompt_tokens
            )
            ids = ids[-self.max_prompt_tokens :]
        state.token_ids = ids
        state.prompt_length = len(ids)
        state.response_mask = []
        state.response_logprobs = None

    def append_turn(self, state: RolloutState, turn: GeneratedTurn) -> None:
        merge = self.builder.merge_assistant_tokens(state.token_ids, list(turn.token_ids or ()))
        logprobs = list(turn.logprobs) if turn.logprobs is not None else None
        if logprobs is not None and state.response_logprobs is None:
            state.response_logprobs = [0.0] * len(state.response_mask)
        state.response_mask, aligned = self.builder.align_response_metadata(
            merge,
            state.response_mask,
            state.response_logprobs,
            assistant_logprobs=logprobs if state.response_logprobs is not None else None,
        )
        if state.response_logprobs is not None:
            state.response_logprobs = aligned
        state.token_ids = merge.token_ids

    def append_observation(self, state: RolloutState, previous: list[dict[str, str]]) -> bool:
        merge = self.builder.merge_context_tokens(previous, state.messages, state.token_ids)
        mask, logprobs = self.builder.align_response_metadata(
            merge, state.response_mask, state.response_logprobs
        )
        if len(mask) >= state.max_response_tokens:
            return False  # VERL: an observation that would overflow ends the trajectory unappended
        state.token_ids = merge.token_ids
        state.response_mask = mask
        if state.response_logprobs is not None:
            state.response_logprobs = logprobs
        return True


def encode_dialogue(
    messages: Sequence[Mapping[str, str]],
    tokenizer: Any,
    *,
    model_type: str | None = None,
    builder: Any = None,
) -> tuple[list[int], list[int], list[int]]:
    """Token layout of a finished chat (e.g. a scripted demonstration), as the HF rollout lays it out.

    The messages before the first assistant turn form the prompt; every assistant turn becomes its
    tokens plus the end-of-turn token (mask 1), every later user turn is encoded by VERL's builder
    (mask 0). Returns ``(prompt_ids, response_ids, response_mask)``.
    """
    builder = builder or make_token_builder(tokenizer, model_type)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    history = [dict(m) for m in messages[:first]]
    ids = list(builder.build_initial_tokens(history))
    prompt_length = len(ids)
    mask: list[int] = []
    eos = tokenizer.eos_token_id
    for message in messages[first:]:
        if message["role"] == "assistant":
            turn = list(tokenizer.encode(message["content"], add_special_tokens=False)) + [eos]
            merge = builder.merge_assistant_tokens(ids, turn)
        else:
            merge = builder.merge_context_tokens(history, [*history, dict(message)], ids)
        mask, _ = builder.align_response_metadata(merge, mask)
        ids = merge.token_ids
        history.append(dict(message))
    return ids[:prompt_length], ids[prompt_length:], mask


def examples_from_dialogues(
    tokenizer: Any, conversations: Iterable[Sequence[Mapping[str, str]]], *, model_type: str | None = None,
    max_length: int | None = None,
) -> list[SFTExample]:
    """Chat conversations → warm-start examples (:mod:`spader_pipeline.modeling.warm_start`) in the
    rollout's token layout (:func:`encode_dialogue`), loss on the assistant turns only."""
    builder = make_token_builder(tokenizer, model_type)
    out = []
    for messages in conversations:
        prompt, response, mask = encode_dialogue(messages, tokenizer, builder=builder)
        example = example_from_tokens(prompt, response, mask)
        if max_length is not None:
            example = SFTExample(example.input_ids[:max_length], example.loss_mask[:max_length])
        out.append(example)
    return out


def pad_batch(
    trajectories: Sequence[Any],
    pad_token_id: int,
    *,
    max_prompt_tokens: int | None = None,
    max_response_tokens: int | None = None,
) -> dict[str, torch.Tensor]:
    """VERL's batch layout from token-level trajectories.

    Prompts are left-padded, responses right-padded. Returns ``prompts`` [B, P], ``responses``
    [B, R], ``response_mask`` [B, R] (1 model tokens, 0 observation tokens and padding),
    ``attention_mask`` [B, P + R] (1 on every real token, observations included) and
    ``input_ids`` [B, P + R].
    """
    prompt_len = max_prompt_tokens or max(len(t.prompt_ids) for t in trajectories)
    resp_len = max_response_tokens or max(1, max(len(t.response_ids) for t in trajectories))
    batch = len(trajectories)
    prompts = torch.full((batch, prompt_len), pad_token_id, dtype=torch.long)
    responses = torch.full((batch, resp_len), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((batch, resp_len), dtype=torch.long)
    attention = torch.zeros((batch, prompt_len + resp_len), dtype=torch.long)
    for row, t in enumerate(trajectories):
        p = list(t.prompt_ids)[-prompt_len:]
        r = list(t.response_ids)[:resp_len]
        m = list(t.response_mask)[:resp_len]
        prompts[row, prompt_len - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention[row, prompt_len - len(p) : prompt_len] = 1
        if r:
            responses[row, : len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask[row, : len(m)] = torch.tensor(m, dtype=torch.long)
            attention[row, prompt_len : prompt_len + len(r)] = 1
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "attention_mask": attention,
        "input_ids": torch.cat([prompts, responses], dim=1),
    }
