"""A text-protocol search agent loop for stock VERL, registered as ``spader_search``.

The loop *is* the project's rollout (:func:`spader_pipeline.agent.rollout.run_rollouts`) with a
generator that asks VERL's rollout server for each turn: parsing (last ``<tool_call>`` /
``<answer>`` block), corrective observations, observation text (:mod:`.search_tool` settings), turn
and token limits and the token layout (:class:`spader_pipeline.agent.tokens.TokenLayout` on VERL's
own Continuous-Token builder) are the same code the native trainer and evaluation run.

Select it per row with the dataset's ``agent_name`` column (data_prep writes ``spader_search``)
after registering it with ``actor_rollout_ref.rollout.agent.agent_loop_config_path=
conf/base/verl/agent_loops.yaml`` (or by importing :mod:`spader_pipeline.verl_plugin`). It needs
the search tool declared in ``rollout.multi_turn.tool_config_path`` (for its retrieval settings).

Limits: ``multi_turn.max_assistant_turns`` (turns), ``rollout.response_length`` (token budget of the
whole response, observations included), ``rollout.custom.max_turn_tokens`` (tokens of one assistant
turn, sent as the request's ``max_new_tokens``; unset: the server's own rule), ``multi_turn.max_tool_response_length`` (characters of one
observation, head kept), ``rollout.prompt_length`` (prompt tokens, left-truncated as VERL does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from spader_pipeline.agent.rollout import run_rollouts
from spader_pipeline.agent.tokens import TokenLayout
from spader_pipeline.agent.types import GeneratedTurn, Generator, RolloutState
from spader_pipeline.verl_plugin.search_tool import SearchTool
from spader_pipeline.verl_plugin.trajectory import MASK_FIELD, SEARCH_CALLS_FIELD, SEARCH_ERRORS_FIELD

AGENT_NAME = "spader_search"
#: ``actor_rollout_ref.rollout.custom`` key: most tokens one assistant turn may sample (the native
#: trainer's ``max_new_tokens``); unset, a turn may use what is left of the response budget
MAX_TURN_TOKENS_KEY = "max_turn_tokens"


def search_counts(steps: Sequence[Any]) -> tuple[int, int]:
    """``(calls, failures)``: searches sent to the retrieval service, and those the service itself
    failed (``error_kind == "search_failed"``; a refused query is the agent's error, not a failure)."""
    calls = [s for s in steps if s.kind == "search" and s.queries]
    failures = [s for s in calls if s.error_kind == "search_failed"]
    return len(calls), len(failures)


class _ServerGenerator(Generator):
    """Assistant turns from VERL's rollout server (``server_manager.generate``), token level."""

    token_level = True

    def __init__(self, loop: SearchAgentLoop, sampling_params: dict[str, Any], request_id: str) -> None:
        self.loop = loop
        self.sampling_params = sampling_params
        self.request_id = request_id
        self.layout = TokenLayout(loop.continuous_token_builder, loop.rollout_config.prompt_length)
        self.generate_seconds = 0.0
        self.num_preempted = -1

    # Token hooks run VERL's Continuous-Token builder (chat template, tokenizer) in the default
    # thread pool, as verl's own agent loops do: the worker's event loop keeps serving the other
    # trajectories' turns and searches meanwhile.

    async def start(self, state: RolloutState) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.layout.start, state)

    async def append_turn(self, state: RolloutState, turn: GeneratedTurn) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.layout.append_turn, state, turn)

    async def append_observation(self, state: RolloutState, previous: list[dict[str, str]]) -> bool:
        return await asyncio.get_running_loop().run_in_executor(
            None, self.layout.append_observation, state, previous
        )

    async def generate(self, states: Sequence[RolloutState]) -> list[GeneratedTurn]:
        turns = []
        for state in states:  # one trajectory per agent loop instance
            start = time.perf_counter()
            params = self.sampling_params
            if self.loop.max_turn_tokens:  # the turn's cap, within what is left of the response budget
                left = state.max_response_tokens - state.response_length
                params = {**params, "max_new_tokens": max(1, min(self.loop.max_turn_tokens, left))}
            output = await self.loop.server_manager.generate(
                request_id=self.request_id, prompt_ids=state.token_ids, sampling_params=params
            )
            self.generate_seconds += time.perf_counter() - start
            if output.num_preempted is not None:
                self.num_preempted = max(self.num_preempted, 0) + output.num_preempted
            ids = list(output.token_ids)
            text = self.loop.tokenizer.decode(ids, skip_special_tokens=True)
            logprobs = tuple(output.log_probs) if output.log_probs else None
            turns.append(GeneratedTurn(text=text, token_ids=tuple(ids), logprobs=logprobs))
        return turns


@register(AGENT_NAME)
class SearchAgentLoop(AgentLoopBase):
    """Multi-turn search agent speaking the project's text protocol (see the module docstring)."""

    def __init__(self, *args, tools: Any = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tool_list = list(getattr(tools, "tools", None) or [])
        self.search_tool = next((t for t in tool_list if isinstance(t, SearchTool)), None)
        if self.search_tool is None:
            raise ValueError(
                f"{AGENT_NAME} needs the project's SearchTool in rollout.multi_turn.tool_config_path "
                "(conf/base/verl/tool_config/search_tool.yaml)"
            )
        multi_turn = self.rollout_config.multi_turn
        tool = self.search_tool.rollout_config
        # every search setting is the tool's (passages per query, characters per passage and per call, queries
        # per call); verl's multi_turn block sets the turns, the response budget and the observation's cap
        self.limits = dataclasses.replace(
            tool,
            max_turns=int(multi_turn.max_assistant_turns or 8),
            max_response_tokens=int(self.rollout_config.response_length),
            max_observation_chars=int(multi_turn.max_tool_response_length or tool.max_observation_chars or 0)
            or None,
        )
        custom = dict(getattr(self.rollout_config, "custom", None) or {})
        self.max_turn_tokens = int(custom.get(MAX_TURN_TOKENS_KEY) or 0) or None

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        extra_info = kwargs.get("extra_info") or {}
        sample = {
            "id": str(extra_info.get("id", extra_info.get("index", ""))),
            "question": str(extra_info.get("question", "")),
            "messages": list(kwargs["raw_prompt"]),
        }
        generator = _ServerGenerator(self, sampling_params, uuid4().hex)
        start = time.perf_counter()
        [trajectory] = await run_rollouts([sample], generator, self.search_tool.client(), self.limits, None)
        total = time.perf_counter() - start
        length = self.limits.max_response_tokens
        observations = sum(1 for s in trajectory.steps if s.observation is not None)
        calls, failures = search_counts(trajectory.steps)
        return AgentLoopOutput(
            prompt_ids=trajectory.prompt_ids,
            response_ids=trajectory.response_ids[:length],
            response_mask=trajectory.response_mask[:length],
            response_logprobs=trajectory.response_logprobs[:length] if trajectory.response_logprobs else None,
            num_turns=trajectory.num_turns + observations + 1,
            metrics={
                "generate_sequences": generator.generate_seconds,
                "tool_calls": max(0.0, total - generator.generate_seconds),
                "num_preempted": generator.num_preempted,
            },
            extra_fields={
                # The reward manager splits steps on this mask (its fallback, splitting on
                # <tool_response> blocks in decoded text, misreads a model-written fake block).
                # Not named `response_mask`: verl copies every extra field into the batch's
                # non-tensor part, where that name collides with its own tensor.
                MASK_FIELD: list(trajectory.response_mask[:length]),
                "finish_reason": trajectory.finish_reason,
                SEARCH_CALLS_FIELD: calls,
                SEARCH_ERRORS_FIELD: failures,
                "tool_call_counts": calls,  # verl logs tool_call_counts/{min,max,mean}
                "search_queries": [list(s.queries) for s in trajectory.steps],
                "retrieved_doc_ids": [s.doc_ids for s in trajectory.steps],
                "turn_scores": [],
                "tool_rewards": [],
            },
        )
