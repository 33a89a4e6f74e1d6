"""The decoding engine behind :class:`~spader_pipeline.agent.hf_backend.HFGenerator`: the next assistant
turn of many trajectories at once with a ``transformers`` causal LM, and the mechanics that make it
fast on a CPU or one GPU, each exact (the same tokens as encoding every row from scratch):

* the KV cache kept between a batch's turns, so a continued turn encodes only its new tokens
  (:meth:`DecodeEngine._inputs`), its masked gaps closed when they grow (:meth:`DecodeEngine._close_gaps`);
* a context several rows share (a group's prompt, the template's instruction) encoded once
  (:meth:`DecodeEngine._shared_prefill`);
* decoding that stops computing a finished row (:func:`spader_pipeline.modeling.decode.decode_batch`,
  whose continued prefill runs in blocks of rows of similar length), else ``model.generate``;
* the capture of a decoder block's states for the native trainer's update
  (:class:`~spader_pipeline.agent.state_capture.StateCapture`).

The engine sees only token ids (:class:`~spader_pipeline.agent.types.RolloutState`'s ``token_ids``,
``uid`` and response budget); the agent's token layout is the adapter's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

from spader_pipeline.agent.state_capture import CapturedStates, StateCapture
from spader_pipeline.agent.types import GeneratedTurn, RolloutState, SamplingParams
from spader_pipeline.modeling.boundary import decoder_blocks
from spader_pipeline.modeling.decode import (
    decode_batch,
    generation_processors,
    left_aligned_positions,
    supports_decode_batch,
)
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.precision import bf16_inference
from spader_pipeline.modeling.shared_prefix import common_prefix_length

__all__ = ["DecodeEngine"]

logger = logging.getLogger(__name__)


class DecodeEngine:
    """Generate the next turn of a batch of trajectories with a causal LM (arguments: those of
    :class:`~spader_pipeline.agent.hf_backend.HFGenerator` but the token layout's).

    The counters (``generated_tokens``, ``decode_steps``, ``model_seconds``, ``kv_reuses``…) add up
    over the engine's life, for throughput reporting and tests.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingParams | None = None,
        *,
        micro_batch_size: int = 32,
        reuse_kv_cache: bool = True,
        bf16: bool = False,
        growing_kv_cache: bool = True,
        drop_finished_rows: bool = True,
        prefill_block_cost: tuple[int, int] | str | None = "auto",
        capture_states_from_layer: int | None = None,
        return_log_probs: bool = False,
    ) -> None:
        self.model = model.eval()
        self.return_log_probs = return_log_probs
        self.growing_kv_cache = growing_kv_cache
        self.drop_finished_rows = drop_finished_rows and self._can_drop_finished_rows()
        self.prefill_block_cost = prefill_block_cost
        self.bf16 = bf16
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingParams()
        self.micro_batch_size = micro_batch_size
        self.reuse_kv_cache = reuse_kv_cache
        self._kv: dict[str, Any] | None = None
        self.kv_reuses = 0  # generate calls that continued from the cache (for tests and reporting)
        self.shared_prefills = 0  # fresh batches whose shared contexts were encoded once
        self.shared_prefix_tokens = 0  # prompt tokens not encoded again thanks to a shared prefix
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        )
        self.generated_tokens = 0  # running count, for throughput reporting
        self.sampled_rows = 0  # rows sampled over all decoding steps (padding included), for reporting
        self.gap_share = 0.1  # close the cache's gaps when at least this share of it is masked
        self.gap_compactions = 0  # turns whose cache gaps were closed (for tests and reporting)
        self.blocked_prefills = 0  # turns whose prefill ran in several blocks of rows (the same)
        self.model_seconds = 0.0  # wall time in the model's turns (prefill, decoding, state capture)
        # of it, decode_batch's prefill forwards and decoding steps (each ended by a wait for the device), and
        # the prefill's real tokens against the positions its forwards computed (the rest padding)
        self.prefill_seconds = 0.0
        self.decoding_seconds = 0.0
        self.prefill_tokens = 0
        self.prefill_positions = 0
        self.decode_steps = 0  # decoding steps over all turns (each as long as its longest row)
        self._processors: Any = None
        self._generator = None
        if self.sampling.seed is not None:
            self._generator = torch.Generator(device="cpu").manual_seed(self.sampling.seed)
        self.capture: StateCapture | None = None
        if capture_states_from_layer is not None:
            if self.drop_finished_rows and 0 <= capture_states_from_layer < len(decoder_blocks(model) or ()):
                self.capture = StateCapture(model, capture_states_from_layer)
            else:
                logger.warning("no state capture: needs decode_batch and a decoder block %s", capture_states_from_layer)

    def _can_drop_finished_rows(self) -> bool:
        reason = None
        if not self.growing_kv_cache:
            reason = "it needs a GrowingKVCache (growing_kv_cache=False)"
        elif not supports_decode_batch(self.model):
            reason = f"{type(self.model).__name__} does not take a cache, mask and position ids"
        if reason:
            (logger.info if not self.growing_kv_cache else logger.warning)("decoding with model.generate: %s", reason)
        return reason is None

    def track(self, uid: str) -> None:
        """A trajectory starts: its states are captured under ``uid`` (with ``capture_states_from_layer``)."""
        if self.capture is not None:
            self.capture.started.append(uid)

    def captured_states(self) -> list[CapturedStates | None]:
        """Per trajectory, in the order they were tracked, the states captured at its leading tokens
        (``capture_states_from_layer``; ``None``: nothing usable was captured)."""
        return self.capture.in_start_order() if self.capture is not None else []

    def release(self) -> None:
        """Free the KV cache kept between turns."""
        self._kv = None

    def generate(self, states: list[RolloutState]) -> list[GeneratedTurn]:
        """The next turn of every state, ``micro_batch_size`` at a time (blocking: the model runs here)."""
        out: list[GeneratedTurn] = []
        started = time.perf_counter()
        with self.capture.hooked() if self.capture is not None else contextlib.nullcontext():
            for i in range(0, len(states), self.micro_batch_size):
                out.extend(self._generate_batch(states[i : i + self.micro_batch_size]))
        self.model_seconds += time.perf_counter() - started  # the turns' tokens are on the host: synced
        return out

    def _sampling_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "pad_token_id": self.pad_id,
            "eos_token_id": sorted(self.eos_ids),
            "return_dict_in_generate": True,
        }
        if self.sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p)
            kwargs["top_k"] = self.sampling.top_k if self.sampling.top_k > 0 else None
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs

    def _inputs(self, states: list[RolloutState]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Physical input ids and attention mask for ``states`` (+ the KV cache to continue from).

        Fresh batch: every context left-padded. Continuing batch (same trajectories as the last
        call, or a subset in the same order): the cached physical rows are kept as they are and only
        each row's new tokens (last sampled token + observation) are appended, left-padded; padding
        inside a row is masked out, and position ids follow the mask, so the cache stays valid.
        """
        kv = self._kv
        if kv is not None and self.reuse_kv_cache and len(states) <= self.micro_batch_size:
            index = {uid: row for row, uid in enumerate(kv["uids"])}
            rows = [index.get(s.uid) for s in states]
            if None not in rows and rows == sorted(rows):
                cached = kv["cache"].get_seq_length()
                physical, mask = kv["ids"][rows, :cached], kv["mask"][rows, :cached]
                new: list[list[int]] = []
                for row, state in enumerate(states):
                    logical = physical[row][mask[row] == 1].tolist()
                    if state.token_ids[: len(logical)] != logical or len(state.token_ids) == len(logical):
                        new = []
                        break
                    new.append(state.token_ids[len(logical) :])
                if new:
                    where = {row: k for k, row in enumerate(kv.get("cache_rows") or range(len(kv["uids"])))}
                    cache_rows = [where[row] for row in rows]  # decode_batch leaves the cache rows permuted
                    if cache_rows != list(range(len(kv["uids"]))):
                        try:
                            kv["cache"].batch_select_indices(torch.tensor(cache_rows, device=self._device()))
                        except (AttributeError, NotImplementedError, RuntimeError):
                            self._kv = None
                            return self._inputs(states)
                    if self.drop_finished_rows:
                        physical, mask = self._close_gaps(kv["cache"], physical, mask)
                    width = max(len(n) for n in new)
                    ids = torch.full((len(states), width), self.pad_id, dtype=torch.long)
                    att = torch.zeros((len(states), width), dtype=torch.long)
                    for row, extra in enumerate(new):
                        ids[row, width - len(extra) :] = torch.tensor(extra, dtype=torch.long)
                        att[row, width - len(extra) :] = 1
                    self.kv_reuses += 1
                    return torch.cat([physical, ids], 1), torch.cat([mask, att], 1), kv["cache"]
        self._kv = None
        prefix = self._common_prefix_length(states)
        width = max(len(s.token_ids) for s in states)
        ids = torch.full((len(states), width), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(states), width), dtype=torch.long)
        ids[:, :prefix] = torch.tensor(states[0].token_ids[:prefix], dtype=torch.long)
        att[:, :prefix] = 1
        for row, state in enumerate(states):  # the shared prefix, then each row's rest left-padded
            rest = state.token_ids[prefix:]
            ids[row, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            att[row, width - len(rest) :] = 1
        return ids, att, self._shared_prefill(states, ids, att, prefix)

    def _close_gaps(self, cache: Any, physical: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Move every row's cached real tokens to the right end (left padding only) when masked positions
        (left padding, the tails of turns that ended before the longest, the padding of shorter
        observations) are at least ``gap_share`` of the cache: each later step attends over fewer
        positions, for one copy of the cache. Exact: keys keep their (logical) positions."""
        if mask.numel() == 0 or 1 - float(mask.sum()) / mask.numel() < self.gap_share:
            return physical, mask
        index, new_mask = left_aligned_positions(mask)
        try:
            cache.gather_positions(index.to(self._device()))
        except AttributeError:  # a cache without it: keep the gaps
            return physical, mask
        self.gap_compactions += 1
        return torch.where(new_mask == 1, physical.gather(1, index), self.pad_id), new_mask

    def _common_prefix_length(self, states: list[RolloutState]) -> int:
        """Tokens every context of a fresh batch starts with (the prompt template's instruction),
        at most all but each context's last token; 0 when there is nothing worth sharing."""
        if not self.reuse_kv_cache or len(states) < 2:
            return 0
        shortest = min(len(s.token_ids) for s in states)
        heads = torch.tensor([s.token_ids[:shortest] for s in states], dtype=torch.long)  # [B, shortest]
        return common_prefix_length(heads, torch.ones_like(heads))

    def _shared_prefill(self, states: list[RolloutState], ids: torch.Tensor, att: torch.Tensor, prefix: int = 0) -> Any:
        """Encode shared context once and copy its KV cache to the rows that share it.

        Two kinds of sharing, both exact (the same positions and attention as encoding each row):
        ``prefix`` leading tokens common to every row (the instruction of the prompt template,
        ``ids[:, :prefix]``; evaluation batches of distinct questions) are encoded once for the
        whole batch; and identical contexts (the trajectories of a GRPO group start from the same
        prompt) are encoded once per distinct context, so ``prompts × group_size`` rows need only
        ``prompts`` prefills. The cache holds all but the last position; ``generate`` encodes that
        one and samples every row independently. Returns ``None`` (plain ``generate``) when nothing
        is shared or caching is off. Only the decoder body runs here: no output-layer logits.
        """
        if not self.reuse_kv_cache or ids.shape[1] < 2:
            return None
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(s.token_ids), len(first)) for s in states]
        if len(first) == len(states) and prefix == 0:
            return None
        unique_rows = [source.index(u) for u in range(len(first))]
        device = self._device()
        body = self.model.base_model
        context_ids, context_att = ids[unique_rows, :-1].to(device), att[unique_rows, :-1].to(device)
        positions = (context_att.cumsum(-1) - 1).clamp(min=0)  # as generate() derives them from the mask
        with self._inference(device):
            cache = self._new_cache()
            if prefix:
                cache = body(input_ids=context_ids[:1, :prefix], past_key_values=cache, use_cache=True).past_key_values
                cache.batch_select_indices(torch.zeros(len(unique_rows), dtype=torch.long, device=device))
                self.shared_prefix_tokens += prefix * (len(states) - 1)
            if context_ids.shape[1] > prefix:
                cache = body(
                    input_ids=context_ids[:, prefix:], attention_mask=context_att,
                    position_ids=positions[:, prefix:], past_key_values=cache, use_cache=True,
                ).past_key_values
        cache.batch_select_indices(torch.tensor(source, device=device))
        self.shared_prefills += 1
        return cache

    def _new_cache(self) -> Any:
        """An empty KV cache of the configured kind (``None``: let the model create a ``DynamicCache``)."""
        return GrowingKVCache(capture_states=self.capture is not None) if self.growing_kv_cache else None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _inference(self, device: torch.device):
        """No-grad, under bf16 autocast on ``device`` when ``bf16`` is set (prefill and generation
        alike), every weight cast once per turn (:func:`~spader_pipeline.modeling.precision.bf16_inference`)."""
        return bf16_inference(self.model, device.type, bool(self.bf16))

    @torch.no_grad()
    def _generate_batch(self, states: list[RolloutState]) -> list[GeneratedTurn]:
        budgets = [
            max(1, min(self.sampling.max_new_tokens, s.max_response_tokens - s.response_length))
            for s in states
        ]
        device = self._device()
        input_ids, attention, cache = self._inputs(states)
        width = input_ids.shape[1]
        if self._generator is not None:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self._generator)))
        kwargs = self._sampling_kwargs(max(budgets))
        continues_cache = cache is not None  # a continued or shared-prefill cache, not a fresh one
        if self.drop_finished_rows and self._processors is None:
            self._processors = generation_processors(self.model, kwargs, input_ids.to(device)) or False
            if not self._processors:
                logger.warning("decoding with model.generate: generation settings beyond row-wise sampling")
        if self.drop_finished_rows and self._processors:
            return self._decode_batch(states, budgets, input_ids, attention, cache)
        if self.capture is not None:
            logger.warning("no state capture: turns decoded with model.generate")
            self.capture = None
        if cache is None and self.reuse_kv_cache:
            cache = self._new_cache()
        if cache is not None:
            kwargs["past_key_values"] = cache
        try:
            with self._inference(device):
                out = self.model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention.to(device), **kwargs
                )
        except Exception:
            if not continues_cache:
                raise
            # A model/cache type that cannot continue this way: re-encode, and stop trying.
            logger.warning("KV-cache continuation failed; re-encoding contexts from now on", exc_info=True)
            self.reuse_kv_cache, self._kv = False, None
            return self._generate_batch(states)
        sequences = out.sequences.cpu()
        self.sampled_rows += len(states) * (sequences.shape[1] - width)
        self.decode_steps += sequences.shape[1] - width
        generated_mask = torch.zeros((len(states), sequences.shape[1] - width), dtype=torch.long)
        turns = []
        for row, budget in enumerate(budgets):
            ids = sequences[row, width:].tolist()[:budget]
            for pos, tok in enumerate(ids):
                if tok in self.eos_ids:
                    ids = ids[: pos + 1]
                    break
            generated_mask[row, : len(ids)] = 1
            self.generated_tokens += len(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            turns.append(GeneratedTurn(text=text, token_ids=tuple(ids)))
        if self.reuse_kv_cache and len(states) <= self.micro_batch_size and out.past_key_values is not None:
            self._kv = {
                "uids": [s.uid for s in states],
                "ids": sequences,
                "mask": torch.cat([attention, generated_mask], 1),
                "cache": out.past_key_values,
            }
        return turns

    def _decode_batch(self, states: list[RolloutState], budgets: list[int], input_ids: torch.Tensor,
                      attention: torch.Tensor, cache: Any) -> list[GeneratedTurn]:
        """``_generate_batch`` with :func:`decode_batch`: the same turns, finished rows not decoded."""
        device = self._device()
        processors, do_sample = self._processors
        cache = cache if cache is not None else self._new_cache()
        with self._inference(device):
            result = decode_batch(
                self.model, input_ids.to(device), attention.to(device), cache, budgets,
                eos_ids=self.eos_ids, pad_id=self.pad_id, processors=processors, do_sample=do_sample,
                prefill_block_cost=self.prefill_block_cost,
                log_prob_temperature=self.sampling.temperature if self.return_log_probs else None,
            )
        self.sampled_rows += result.row_steps
        self.decode_steps += result.steps
        self.prefill_seconds += result.prefill_seconds
        self.decoding_seconds += result.decoding_seconds
        self.prefill_tokens += result.prefill_tokens
        self.prefill_positions += result.prefill_positions
        self.blocked_prefills += result.prefill_blocks > 1
        keep = self.reuse_kv_cache and len(states) <= self.micro_batch_size
        if keep or self.capture is not None:  # the cached ids and mask, read from the device once for both
            cached_ids, cached_mask = result.ids.cpu(), result.mask.cpu()
        if self.capture is not None:
            self.capture.record([s.uid for s in states], cache, cached_ids, cached_mask, result.cache_rows)
        turns = []
        for row, ids in enumerate(result.tokens):
            self.generated_tokens += len(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            logprobs = tuple(result.log_probs[row]) if result.log_probs is not None else None
            turns.append(GeneratedTurn(text=text, token_ids=tuple(ids), logprobs=logprobs))
        if keep:
            self._kv = {
                "uids": [s.uid for s in states],
                "ids": cached_ids,
                "mask": cached_mask,
                "cache": cache,
                "cache_rows": result.cache_rows,
            }
        return turns
