"""The rollout server on the project's decoder: verl's token-in/token-out ``generate``, batched.

verl's agent loops send one assistant turn per request (``generate(request_id, *, prompt_ids,
sampling_params) -> TokenOutput``), each trajectory on its own, many at once. :class:`DecoderServer`
gathers them into batches for the rollout engine that ``rollout.custom.engine`` names
(:mod:`spader_pipeline.agent.engines`). The default, ``hf``, is
:class:`~spader_pipeline.agent.hf_backend.HFGenerator`, the in-process decoder the native trainer and
evaluation use: KV-cached batches that drop finished rows, shared-prefix prefill, and a batch's cache
continued by the next turns of its sequences (verl sends every turn under a fresh request id, so
continuations are found by their tokens, as a prefix cache finds them). Each turn returns its tokens'
log-probabilities at the sampling temperature.

The sequences one batch produced are a *cohort*; each cohort keeps its own decoder and KV cache, and a
batch is either the next turns of one cohort (its cache continued: only the new tokens are encoded) or
requests that continue nothing the server holds (a fresh prefill; it starts a cohort). A cohort's next
batch starts as soon as every one of its sequences has come back; else (trajectories that ended never come
back) once none came for ``batch_window_s`` and the first came at least :func:`cohort_wait` ago (2% of the
cohort's last decoding time, between ``batch_window_s`` and ``MAX_WAIT_S``), at most ``MAX_WAIT_S`` after
the first. A straggler that misses the batch loses its cache row and is prefilled afresh. So one late
request (a slow search, a stalled agent loop) costs a re-prefill of its own context, and a turn split in
two goes on as two cohorts that each continue their cache, where one cache per server would re-encode
every context of every later turn. Fresh requests are gathered as they
arrive (within ``batch_window_s`` of each other, at most ``MAX_WAIT_S`` after the first). The cohorts'
caches hold at most ``max_num_seqs`` rows together, the batch being decoded included (the least recently
decoded cohorts give theirs up first).

The per-turn token budget is the one verl's SGLang server applies: ``max_new_tokens`` (or
``max_tokens``) when the request sets it, else ``min(response_length, prompt_length +
response_length - len(prompt))``; always at most ``max_model_len - len(prompt) - 1``; a prompt past
the context is refused.

The lifecycle verl calls: ``sleep``/``wake_up`` (with ``free_cache_engine``, verl's default, the weights
leave the device while the trainer runs on CUDA; the KV cache is dropped on every device),
``clear_kv_cache``, ``set_global_steps``, ``abort_all_requests``/``resume_generation`` (queued requests
wait for the resume, or are answered ``aborted`` when the replica leaves), and ``load_weights``, through
which the in-worker adapter (:class:`~.replica.DecoderServerAdapter`) hands over the actor's weights that
verl's checkpoint engine yields.
A batch decoding, a weight update, a cache clear, sleep and wake-up change the model's device state one at
a time (a batch decodes in a worker thread: a CUDA graph being captured or replayed there must not see
weights copied or moved by the event loop's thread). Sleep with ``free_cache_engine`` also lets go of the
static decoding step's cache, graphs and weight copies (:func:`~spader_pipeline.modeling.graph_decode.
release_static_decoders`); without it they stay, and serve the next step's turns.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import torch

from spader_pipeline.modeling.graph_decode import release_static_decoders, static_decode_stats
from spader_pipeline.verl_plugin.decoder_rollout.batching import (
    BATCH_WINDOW_S,
    MAX_WAIT_S,
    Cohort,
    Request,
    SamplingKey,
    cohort_wait,
    turn_budget,
)
from spader_pipeline.verl_plugin.decoder_rollout.weights import tied_to_embeddings, weights_checksum

logger = logging.getLogger(__name__)

#: ``actor_rollout_ref.rollout.custom`` key: the rollout engine the server decodes with
#: (:mod:`spader_pipeline.agent.engines`; it must return log-probabilities); unset: ``hf``
ENGINE_KEY = "engine"
#: the engine's counters the server adds up over its batches (where the engine keeps them): cache rows
#: continued, decoding steps (each as long as the batch's longest row: a step's cost at a few rows does
#: not depend on how many), rows sampled over them, seconds in the model, and of those the turns' prefill
#: forwards and their decoding steps (``decode_seconds`` beside them is the batches' wall time)
_ENGINE_COUNTERS = ("kv_reuses", "decode_steps", "sampled_rows", "model_seconds", "prefill_seconds",
                    "decoding_seconds")


class DecoderServer:
    """One replica's server (a Ray actor, :class:`~.replica.DecoderReplica` starts it).

    Args:
        config: verl's ``RolloutConfig`` (``prompt_length``, ``response_length``, ``max_model_len``,
            ``max_num_seqs``, ``dtype``, ``free_cache_engine``, ``custom.engine``).
        model_config: verl's ``HFModelConfig`` (``local_path``: the Hugging Face folder to serve).
        device: ``"cpu"`` or ``"cuda"`` (verl's platform device).
        visible_devices: the trainer worker's ``CUDA_VISIBLE_DEVICES`` (the server shares its GPU).
    """

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, device: str = "cpu",
                 visible_devices: str | None = None, batch_window_s: float = BATCH_WINDOW_S) -> None:
        if visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        from spader_pipeline.agent.engines import DEFAULT_ENGINE, check_engine
        from spader_pipeline.modeling import load_model_and_tokenizer
        from spader_pipeline.modeling.precision import resolve_bf16

        self.config, self.replica_rank = config, replica_rank
        self.engine = check_engine(str(dict(getattr(config, "custom", None) or {}).get(ENGINE_KEY) or DEFAULT_ENGINE))
        torch.manual_seed(int(getattr(config, "seed", 0) or 0) + replica_rank)  # rollout.seed: sampling repeats
        self.device = torch.device("cuda" if device == "cuda" else "cpu")
        path = getattr(model_config, "local_path", None) or model_config.path
        self.model, self.tokenizer = load_model_and_tokenizer(path, device=str(self.device))
        dtype = str(getattr(config, "dtype", "bfloat16"))
        self.bf16 = dtype not in ("float32", "fp32") and resolve_bf16("auto", self.device, self.model)
        self.max_model_len = int(config.max_model_len or config.prompt_length + config.response_length)
        self.batch_window_s = batch_window_s
        self.max_batch = max(1, int(getattr(config, "max_num_seqs", 256) or 256))
        self.global_steps: int | None = None
        self._cohorts: list[Cohort] = []  # least recently decoded first
        self._idle: dict[SamplingKey, list[Any]] = {}  # decoders without a cohort, for the next ones
        self._queue: list[Request] = []
        self._arrival = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._reject = False
        self._worker: asyncio.Task | None = None
        self._loaded: set[str] = set()  # the weights of the update in progress
        # the model's device state is changed by one of these at a time: a batch decoding (in a worker thread),
        # a weight update, sleep or wake-up (a CUDA graph being captured must not see another thread's
        # copies, and a replay must not read weights moved away under it)
        self._device = asyncio.Lock()
        self.stats_: dict[str, Any] = {"requests": 0, "batches": 0, "batch_sizes": [], "generated_tokens": 0,
                                       "decode_seconds": 0.0, "stragglers": 0, "weight_updates": [], "aborted": 0,
                                       **dict.fromkeys(_ENGINE_COUNTERS, 0)}

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data:
            raise ValueError("the decoder server serves text only")
        params = dict(sampling_params)
        prompt = [int(t) for t in prompt_ids]
        budget = turn_budget(len(prompt), params, max_model_len=self.max_model_len,
                             prompt_budget=int(self.config.prompt_length), response_length=int(self.config.response_length))
        want = bool(params.get("logprobs", False))
        self.stats_["requests"] += 1
        if budget == 0:
            return TokenOutput(token_ids=[], log_probs=[] if want else None, stop_reason="completed",
                               extra_fields={"global_steps": self.global_steps})
        if self._reject:
            return self._aborted(want)
        request = Request(prompt, budget, SamplingKey.of(params), want, asyncio.get_running_loop().create_future())
        request.cohort = next((c for c in self._cohorts if c.key == request.key and c.find(prompt)), None)
        self._queue.append(request)
        self._arrival.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await request.done

    def _aborted(self, want: bool):
        from verl.workers.rollout.replica import TokenOutput

        self.stats_["aborted"] += 1
        return TokenOutput(token_ids=[], log_probs=[] if want else None, stop_reason="aborted",
                           extra_fields={"global_steps": self.global_steps})

    async def _serve(self) -> None:
        """Decode batches while requests wait: the first group (a cohort's next turns, or the fresh
        requests of a sampling key) that is ready, in the order of their oldest request (module docstring)."""
        while self._queue:
            await self._resumed.wait()
            self._arrival.clear()
            batch, wake = self._ready()
            if batch is None:
                try:
                    await asyncio.wait_for(self._arrival.wait(), timeout=max(0.0, wake - time.monotonic()))
                except asyncio.TimeoutError:
                    pass
                continue
            if not self._resumed.is_set():
                continue
            taken = set(map(id, batch))
            self._queue = [r for r in self._queue if id(r) not in taken]
            try:
                outputs = await self._decode(batch)
            except Exception as exc:  # every waiting request learns why
                for request in batch:
                    if not request.done.done():
                        request.done.set_exception(exc)
                continue
            for request, output in zip(batch, outputs, strict=True):
                if not request.done.done():
                    request.done.set_result(output)

    def _ready(self) -> tuple[list[Request] | None, float]:
        """The batch to decode now (``None``: none is ready) and, when none is, the time to look again."""
        now, wake = time.monotonic(), float("inf")
        groups: dict[tuple[SamplingKey, int], list[Request]] = {}
        for request in self._queue:  # grouped in the order of their oldest request
            groups.setdefault((request.key, id(request.cohort)), []).append(request)
        for group in groups.values():
            cohort = group[0].cohort
            if cohort is not None:  # all its sequences are back, or the rest had their time
                least = group[0].arrived + cohort_wait(cohort.decode_seconds, self.batch_window_s)
                due = min(max(group[-1].arrived + self.batch_window_s, least), group[0].arrived + MAX_WAIT_S)
                ready = len(group) >= min(len(cohort.rows), self.max_batch)
            else:  # fresh: none arrived for a window, or the first waited long enough
                due = min(group[-1].arrived + self.batch_window_s, group[0].arrived + MAX_WAIT_S)
                ready = len(group) >= self.max_batch
            if ready or now >= due:
                return group[: self.max_batch], now
            wake = min(wake, due)
        return None, wake

    def _new_cohort(self, key: SamplingKey) -> Cohort:
        from spader_pipeline.agent.engines import build_generator
        from spader_pipeline.agent.types import SamplingParams

        idle = self._idle.get(key)
        if idle:
            decoder = idle.pop()
        else:
            sampling = SamplingParams(temperature=key.temperature, top_p=key.top_p, top_k=key.top_k,
                                      max_new_tokens=self.max_model_len)
            decoder = build_generator(self.engine, self.model, self.tokenizer, sampling,
                                      max_prompt_tokens=self.max_model_len, micro_batch_size=self.max_batch,
                                      bf16=self.bf16, return_log_probs=True)
        cohort = Cohort(key, decoder)
        self._cohorts.append(cohort)
        return cohort

    async def _drop(self, cohort: Cohort) -> None:
        """Free a cohort's cache (its decoder waits for the next cohort); its queued requests start afresh."""
        self._cohorts.remove(cohort)
        await cohort.decoder.aclose()
        self._idle.setdefault(cohort.key, []).append(cohort.decoder)
        for request in self._queue:
            if request.cohort is cohort:
                request.cohort = None

    @property
    def _decoders(self) -> dict[int, Any]:
        """Every cohort's decoder (tests read their counters)."""
        return {id(c): c.decoder for c in self._cohorts}

    async def _decode(self, batch: list[Request]) -> list[Any]:
        """One batch through a decoder: a cohort's next turns continue its cache (in its row order), fresh
        requests start a new cohort."""
        from verl.workers.rollout.replica import TokenOutput

        from spader_pipeline.agent.types import RolloutState

        cohort, uids = batch[0].cohort, []
        if cohort is not None:  # each request a row of its own (identical sequences: one row each)
            for request in batch:
                uids.append(next((uid for uid in cohort.find(request.prompt_ids) if uid not in uids), None))
        if cohort is None or None in uids:  # (more requests continue a sequence than rows hold it: afresh)
            cohort, uids = self._new_cohort(batch[0].key), [None] * len(batch)
        states = [RolloutState(sample={}, messages=[], token_ids=list(r.prompt_ids), prompt_length=len(r.prompt_ids),
                               max_response_tokens=r.budget, **({"uid": uid} if uid is not None else {}))
                  for r, uid in zip(batch, uids, strict=True)]
        for old in [c for c in self._cohorts if c is not cohort]:  # room for the batch: least recently decoded first
            if sum(len(c.rows) for c in self._cohorts if c is not cohort) + len(batch) <= self.max_batch:
                break
            await self._drop(old)
        rows = {uid: row for row, uid in enumerate(cohort.rows)}
        order = sorted(range(len(batch)), key=lambda i: rows.get(states[i].uid, len(rows) + i))
        decoder = cohort.decoder
        before = {name: getattr(decoder, name, 0) for name in _ENGINE_COUNTERS}  # an engine's, where it keeps them
        started = time.perf_counter()
        try:
            async with self._device:
                turns = await decoder.generate([states[i] for i in order])
        except Exception:
            if cohort in self._cohorts:  # its cache is in no known state
                await self._drop(cohort)
            raise
        seconds = time.perf_counter() - started
        self.stats_["decode_seconds"] += seconds
        self.stats_["batches"] += 1
        self.stats_["batch_sizes"].append(len(batch))
        for name, value in before.items():
            self.stats_[name] += getattr(decoder, name, 0) - value
        outputs: list[Any] = [None] * len(batch)
        produced: list[tuple[tuple[int, ...], str]] = []
        for i, turn in zip(order, turns, strict=True):
            ids = list(turn.token_ids or ())
            self.stats_["generated_tokens"] += len(ids)
            produced.append((tuple(batch[i].prompt_ids + ids), states[i].uid))
            outputs[i] = TokenOutput(token_ids=ids, log_probs=list(turn.logprobs or ()) if batch[i].want_log_probs else None,
                                     stop_reason="completed", extra_fields={"global_steps": self.global_steps})
        if cohort not in self._cohorts:  # its cache was cleared while it decoded (a weight update)
            await decoder.aclose()
            return outputs
        cohort.update(produced, seconds)
        self._cohorts.remove(cohort)
        self._cohorts.append(cohort)  # the most recently decoded last
        for request in self._queue:  # its stragglers: their rows left the cache with this batch
            if request.cohort is cohort:
                request.cohort = None
                self.stats_["stragglers"] += 1
        return outputs

    # ---- lifecycle --------------------------------------------------------------------------

    async def clear_kv_cache(self) -> None:
        async with self._device:  # not under a batch decoding from it
            await self._clear_kv_cache()

    async def _clear_kv_cache(self) -> None:
        for cohort in list(self._cohorts):
            await self._drop(cohort)

    async def release_kv_cache(self) -> None:
        await self.clear_kv_cache()

    async def resume_kv_cache(self) -> None:
        return None

    async def sleep(self) -> None:
        """Drop the KV caches (the next weights make them stale); with ``free_cache_engine`` (verl's default)
        also free what the trainer needs: the static decoding step's cache, graphs and weight copies, and on
        CUDA the weights' device memory. Without it they stay, as vLLM's and SGLang's memory stays: the
        weights keep their addresses, so the next steps replay the captured graphs."""
        async with self._device:
            await self._clear_kv_cache()
            if getattr(self.config, "free_cache_engine", True):
                release_static_decoders(self.model)
                if self.device.type == "cuda":
                    self.model.to("cpu")
                    torch.cuda.empty_cache()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        async with self._device:
            if self.device.type == "cuda" and next(self.model.parameters()).device.type != "cuda":
                self.model.to(self.device)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Hold the queued requests until :meth:`resume_generation` (``reject_request``: answer them,
        and those that arrive until the resume, ``aborted``). A batch already decoding finishes."""
        self._resumed.clear()
        if reject_request:
            self._reject = True
            waiting, self._queue = self._queue, []
            for request in waiting:
                request.done.set_result(self._aborted(request.want_log_probs))

    async def resume_generation(self) -> None:
        self._reject = False
        self._resumed.set()

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    # ---- weights ----------------------------------------------------------------------------

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], *, last: bool = False,
                           global_steps: int | None = None) -> None:
        """Copy a bucket of the actor's weights (Hugging Face names) into the model; with ``last``,
        check that every weight arrived, drop the KV caches and record the update."""
        state = self.model.state_dict()
        unknown = [name for name, _ in named_tensors if name not in state]
        if unknown:
            raise KeyError(f"weights the served model does not have: {unknown[:5]}")
        async with self._device:
            with torch.no_grad():
                for name, tensor in named_tensors:
                    state[name].copy_(tensor.to(state[name].device, dtype=state[name].dtype))
                    self._loaded.add(name)
            if not last:
                return
            missing = [name for name in state if name not in self._loaded and not tied_to_embeddings(self.model, name)]
            checksum = weights_checksum(self.model)
            self._loaded = set()
            if missing:
                raise KeyError(f"a weight update left {len(missing)} weights unchanged: {missing[:5]}")
            await self._clear_kv_cache()
        if global_steps is not None:
            self.global_steps = global_steps
        self.stats_["weight_updates"].append({"global_steps": global_steps, "checksum": checksum, "at": time.time()})

    def stats(self) -> dict[str, Any]:
        """What the server did: requests, batches and their sizes, tokens, decoding seconds (the batches'
        wall time), the engine's counters (:data:`_ENGINE_COUNTERS`), stragglers, weight updates;
        ``decoding``: this process's static-step counters (CUDA graphs captured and replayed, steps launched
        op by op: :func:`~spader_pipeline.modeling.graph_decode.static_decode_stats`)."""
        return {**self.stats_, "global_steps": self.global_steps, "checksum": weights_checksum(self.model),
                "decoding": static_decode_stats()}

    def ready(self) -> bool:
        return True
