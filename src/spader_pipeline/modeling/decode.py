"""Batched token-by-token decoding that stops computing a row as soon as its turn ends.

``model.generate`` decodes every row of a batch until the longest one ends: a row that sampled an
end-of-sequence token or used its token budget keeps decoding padding (about a quarter of the row
steps of an evaluation rollout). :func:`decode_batch` prefills the batch as
``generate`` does, then samples one token per step for the rows still going only. Finished rows are
exchanged with going rows behind them in a :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache`
(all of a step's pairs in one indexed copy per buffer,
:meth:`~spader_pipeline.modeling.kv_cache.GrowingKVCache.move_rows`) and the model
sees the active prefix of the cache, so the cache of every row stays in one piece for the next turn.

A fresh cache's prefill of many rows runs as forwards over chunks of rows
(:data:`PREFILL_CHUNK_TOKENS`), each row's keys and logits the same as in one forward.
A continued turn's prefill (each row's new tokens: its last sampled token and an observation of its
own length) runs in blocks of rows of similar length when that saves more padding than the extra
forwards cost (:func:`~spader_pipeline.modeling.batching.padding_blocks`): rows are ordered by their
number of new tokens, each block is padded only to its longest row
(:meth:`~spader_pipeline.modeling.kv_cache.GrowingKVCache.row_window`), and a shorter row's block ends
in masked positions instead of starting with padding. Exact: every key keeps its logical position.

Each decoding step (one new token per row) runs through
:func:`~spader_pipeline.modeling.decode_step.fused_decode_step` where it applies: the model's own forward,
bit for bit, as tensor code over fused packed weights instead of the modules; elsewhere through the model.
On a GPU (:func:`~spader_pipeline.modeling.graph_decode.static_decoder`) the steps after the prefill run
on the device instead: over a static cache, sampled there, captured in CUDA graphs per bucket of rows and
positions; ended rows are masked and moved behind the going ones between windows of steps, and the
result is laid out as this loop lays it out.

Sampling uses ``generate``'s own logits processors (:func:`generation_processors`) and the same
softmax, then draws by inverse CDF (:func:`sample_categorical`) instead of ``torch.multinomial``,
or takes the argmax when greedy: the same distribution, and greedy decoding gives the same tokens
(up to floating-point reassociation in a smaller batch).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch

from spader_pipeline.modeling.batching import padding_blocks, retire_rows
from spader_pipeline.modeling.decode_step import fused_decode_step
from spader_pipeline.modeling.graph_decode import StaticOutcome, decode_static, static_decoder
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.sampling import sample_categorical, token_log_probs

__all__ = ["DecodeResult", "decode_batch", "generation_processors", "left_aligned_positions", "prefill_block_cost_for",
           "sample_categorical", "supports_decode_batch", "token_log_probs"]

#: logits processors whose result does not depend on the row's place in the batch (``generate`` builds
#: them from the sampling settings); any other processor: decode with ``generate``
ROW_WISE_PROCESSORS = frozenset({
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor", "SuppressTokensLogitsProcessor",
})
#: ``(min_tokens, overhead_tokens)`` of :func:`~spader_pipeline.modeling.batching.padding_blocks` for a
#: continued turn's prefill on a CPU (``decode_batch``'s and ``HFGenerator``'s default there): a forward's
#: fixed cost is small beside a padded token's (measured: docs/results.md, Benchmarks)
PREFILL_BLOCK_COST = (128, 32)
#: the same on a GPU, measured on an H200 (benchmarks/bench_prefill_blocks.py, SmolLM2's shape, 768 rows over
#: 512 cached positions, 60-420 new tokens a row; docs/results.md): 3 forwards over 225,810 positions took
#: 1,126 ms and one padded forward over 322,560 took 670 ms, so a forward there costs ~240,000 positions'
#: time (a fit of the two); a rollout's continued turn is one forward unless padding would waste more
GPU_PREFILL_BLOCK_COST = (128, 262144)
#: most tokens (rows x padded width) one forward of a fresh cache's prefill takes on a CPU; a longer batch
#: is prefilled in chunks of rows (llama.cpp's micro-batch is 512 tokens too). A bigger forward's
#: activations outgrow the CPU's caches and, past glibc's mmap threshold (the Makefile sets 4 MB), are
#: mapped afresh and page-faulted in by every operator (measured: docs/performance.md). Each row's keys
#: and logits are the same either way (a row's products and attention do not depend on the other rows).
PREFILL_CHUNK_TOKENS = 512
#: processors that read only the scores, not the ids before them: with these a row's ids may have
#: masked gaps (a blocked prefill) and the processors still see what ``generate`` would
SCORE_ONLY_PROCESSORS = frozenset({
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper",
})


@dataclass
class DecodeResult:
    """What :func:`decode_batch` returns, rows in the input order unless said otherwise.

    ``tokens``: per row, the sampled tokens (the last one an end-of-sequence token when one was
    sampled). ``ids``/``mask`` ``[B, L]`` (``L`` = the cache length): the physical token ids of the
    cached positions and 1 where a position holds a real token whose keys are in the cache (a row's
    last sampled token is never fed, so it is not cached). ``cache_rows``: the input row held by each
    cache row (the cache rows are permuted). ``row_steps``: rows sampled over all steps.
    ``prefill_blocks``: forwards of the prefill (1: the whole batch at once). ``log_probs``: per row,
    the log-probability of each sampled token (``decode_batch(log_prob_temperature=...)``; else ``None``).
    ``prefill_tokens``: the real tokens the prefill fed (every row's new ones); ``prefill_positions``: the
    positions its forwards computed (rows x padded width, block by block: the rest is padding).
    ``prefill_seconds``, ``decoding_seconds``: wall time of the prefill's forwards and of the steps after
    them, each ended by a wait for the device (where the model is), so a GPU's queued work is in its part.
    """

    tokens: list[list[int]]
    ids: torch.Tensor
    mask: torch.Tensor
    cache_rows: list[int]
    row_steps: int
    prefill_blocks: int = 1
    steps: int = 0
    log_probs: list[list[float]] | None = None
    prefill_tokens: int = 0
    prefill_positions: int = 0
    prefill_seconds: float = 0.0
    decoding_seconds: float = 0.0


def _wait_for(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CPU's operators have run when they return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def supports_decode_batch(model: Any) -> bool:
    """Whether ``model`` is a decoder-only LM whose forward takes a cache, a mask and position ids."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    params = inspect.signature(model.forward).parameters
    return {"past_key_values", "attention_mask", "position_ids"} <= set(params)


def generation_processors(model: Any, generate_kwargs: dict[str, Any], input_ids: torch.Tensor):
    """The logits processors ``model.generate(input_ids, **generate_kwargs)`` would apply
    (the model's ``generation_config`` merged with the keyword arguments, as ``generate`` merges
    them), or ``None`` when that decoding is not plain sampling/greedy with row-wise processors."""
    try:
        config, _ = model._prepare_generation_config(None, **generate_kwargs)
        if (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1 or config.stop_strings:
            return None
        if any(getattr(config, name, None) is not None for name in ("assistant_model", "prompt_lookup_num_tokens")):
            return None
        processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
            prefix_allowed_tokens_fn=None, logits_processor=None, device=input_ids.device, model_kwargs={},
        )
    except (AttributeError, TypeError, ValueError):  # another transformers: decode with generate
        return None
    if any(type(p).__name__ not in ROW_WISE_PROCESSORS for p in processors):
        return None
    return processors, bool(config.do_sample)


def left_aligned_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's real positions go when the masked ones between them are removed.

    ``mask`` ``[B, L]`` (1: real). Returns ``index`` ``[B, L']`` (``L'`` = most real positions of a
    row): the source position of every slot, each row's real positions in order at the right end
    (slots on the left read position 0, masked), and the new mask ``[B, L']``. Gathering a cache and
    its ids with ``index`` keeps every key's logical position (position ids follow the mask).
    """
    lengths = mask.sum(1)
    longest = int(lengths.max())
    new_mask = (torch.arange(longest, device=mask.device) >= longest - lengths[:, None]).long()
    index = torch.zeros(new_mask.shape, dtype=torch.long, device=mask.device)
    index[new_mask == 1] = mask.nonzero()[:, 1]  # both row-major: each row's real positions, in order
    return index, new_mask


def _exchange(holes: list[int], fillers: list[int], tensors: tuple[torch.Tensor, ...], lists: tuple[list, ...],
              cache: GrowingKVCache) -> None:
    """Exchange rows ``holes[k]`` and ``fillers[k]`` of ``tensors`` (dim 0), ``lists`` and ``cache``, all
    pairs at once (one indexed copy per tensor and cache buffer, whatever the number of pairs)."""
    if not holes:
        return
    rows, sources = torch.tensor(holes + fillers), torch.tensor(fillers + holes)
    for tensor in tensors:
        index, source = rows.to(tensor.device), sources.to(tensor.device)
        tensor[index] = tensor[source]
    for items in lists:
        for i, j in zip(holes, fillers, strict=True):
            items[i], items[j] = items[j], items[i]
    cache.move_rows(rows, sources)


def prefill_block_cost_for(device: torch.device | str) -> tuple[int, int]:
    """The prefill's block cost on ``device``: :data:`PREFILL_BLOCK_COST` on a CPU, else
    :data:`GPU_PREFILL_BLOCK_COST`."""
    return PREFILL_BLOCK_COST if torch.device(device).type == "cpu" else GPU_PREFILL_BLOCK_COST


def _can_block(cache: Any, past: int, processors: Any) -> bool:
    """Whether a prefill may run in row blocks: a continued :class:`GrowingKVCache` (every layer
    allocated) and processors that ignore the ids (the rows get masked gaps)."""
    return (isinstance(cache, GrowingKVCache) and past > 0 and len(cache.layers) > 0
            and all(getattr(layer, "_key_buffer", None) is not None for layer in cache.layers)
            and all(type(p).__name__ in SCORE_ONLY_PROCESSORS for p in processors))


def _block_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, past: int, new_lengths: list[int],
                  order: list[int], ends: list[int], blocks: list[range], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and mask ``[B, ends[0]]`` in cache-row order (row ``r`` holds input row ``order[r]``, rows by
    descending number of new tokens ``new_lengths``): the cached part as it was, then each row's new
    tokens ending where its block ends (``ends``, one per block), masked positions after them."""
    ids = input_ids.new_full((len(order), ends[0]), pad_id)
    mask = attention_mask.new_zeros((len(order), ends[0]))
    ids[:, :past], mask[:, :past] = input_ids[order, :past], attention_mask[order, :past]
    for block, end in zip(blocks, ends, strict=True):
        for row in block:
            source = order[row]
            start = end - new_lengths[source]
            ids[row, start:end] = input_ids[source, past:][attention_mask[source, past:] == 1]
            mask[row, start:end] = 1
    return ids, mask


def _static_result(outcome: StaticOutcome, input_ids: torch.Tensor, attention_mask: torch.Tensor, order: list[int],
                   pad_id: int, prefill_blocks: int, timing: dict[str, Any]) -> DecodeResult:
    """:class:`DecodeResult` of :func:`~spader_pipeline.modeling.graph_decode.decode_static` (``input_ids``/
    ``attention_mask``: the prefill's, in its cache-row order ``order``), as the host loop lays it out: a
    row's sampled tokens after its context, each fed one real in the mask, its last one never fed;
    ``timing``: the prefill's counts and seconds (the steps' seconds are the caller's to set)."""
    batch, width = input_ids.shape
    length = width + outcome.steps - 1
    moved = torch.tensor(outcome.rows, device=input_ids.device)  # the prefill's cache row now at each row
    fed = torch.full((batch, outcome.steps - 1), pad_id, dtype=input_ids.dtype)
    for row, tokens in enumerate(outcome.tokens):
        fed[row, : len(tokens) - 1] = torch.tensor(tokens[:-1], dtype=input_ids.dtype)
    ids = torch.cat([input_ids[moved], fed.to(input_ids.device)], dim=1)
    fed_mask = torch.arange(outcome.steps - 1)[None, :] < torch.tensor([len(t) - 1 for t in outcome.tokens])[:, None]
    mask = torch.cat([attention_mask[moved], fed_mask.to(attention_mask)], dim=1)
    holders = [order[row] for row in outcome.rows]  # the input row held by each cache row now
    where = torch.empty(batch, dtype=torch.long)
    where[torch.tensor(holders)] = torch.arange(batch)  # cache row of each input row
    where = where.to(input_ids.device)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    log_probs: list[list[float]] | None = None if outcome.log_probs is None else [[] for _ in range(batch)]
    for row, holder in enumerate(holders):
        tokens[holder] = outcome.tokens[row]
        if log_probs is not None:
            log_probs[holder] = outcome.log_probs[row]
    return DecodeResult(tokens=tokens, ids=ids[where, :length], mask=mask[where, :length], cache_rows=holders,
                        row_steps=sum(len(t) for t in outcome.tokens), prefill_blocks=prefill_blocks,
                        steps=outcome.steps, log_probs=log_probs, **timing)


@torch.no_grad()
def decode_batch(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: GrowingKVCache,
    budgets: list[int],
    *,
    eos_ids: set[int],
    pad_id: int,
    processors: Any,
    do_sample: bool,
    prefill_block_cost: tuple[int, int] | str | None = "auto",
    log_prob_temperature: float | None = None,
    prefill_chunk_tokens: int | None = PREFILL_CHUNK_TOKENS,
) -> DecodeResult:
    """Sample up to ``budgets[b]`` tokens for each row ``b``, a row leaving the batch when it ends.

    Args:
        model: a causal LM (``model(input_ids, attention_mask, position_ids, past_key_values, ...)``).
        input_ids: ``[B, W]`` left-padded contexts on the model's device; the cache already holds the
            first ``C = cache.get_seq_length() < W`` positions of every row (0: a fresh cache).
        attention_mask: ``[B, W]``, 1 on real tokens (padding inside a row allowed: masked out).
        cache: a :class:`GrowingKVCache` (written in place; it holds every row afterwards, rows
            permuted as ``DecodeResult.cache_rows`` says, ``L = W + longest turn - 1`` positions).
        budgets: most tokens per row (≥ 1).
        eos_ids: tokens that end a row's turn (kept as its last token).
        pad_id: the id written at positions that are not real tokens.
        processors: logits processors, called as ``processors(ids [n, W + t], scores [n, V])``
            (:func:`generation_processors`); ``do_sample``: draw from the softmax, else the argmax.
        prefill_block_cost: ``(min_tokens, overhead_tokens)`` of
            :func:`~spader_pipeline.modeling.batching.padding_blocks` for a continued cache's prefill;
            ``"auto"``: the device's (:func:`prefill_block_cost_for`); ``None``: one forward over the whole
            left-padded batch.
        log_prob_temperature: also return each sampled token's log-probability under
            ``log_softmax(logits / log_prob_temperature)`` (fp32, before top-k/top-p: what a trainer
            recomputes at its sampling temperature, as vLLM and SGLang report them); ``None``: none.
        prefill_chunk_tokens: on a CPU, a fresh :class:`GrowingKVCache`'s prefill of more tokens (rows x
            width) than this runs as forwards over chunks of rows of at most this many tokens
            (:data:`PREFILL_CHUNK_TOKENS`); ``None``: one forward (always on a GPU).

    Position ids follow the mask (``cumsum - 1``, as ``generate``), so the cached rows continue
    correctly in the next call with more tokens appended.
    """
    device = input_ids.device
    if prefill_block_cost == "auto":
        prefill_block_cost = prefill_block_cost_for(device)
    past = cache.get_seq_length()
    new_lengths = attention_mask[:, past:].sum(1).tolist()  # each row's new tokens; waits for the device's queue
    prefill_tokens = sum(new_lengths)
    started = time.perf_counter()
    order = list(range(len(budgets)))  # input row held by each cache row
    blocks, ends = [range(len(budgets))], [input_ids.shape[1]]  # row blocks of the prefill, where each ends
    if prefill_block_cost is not None and _can_block(cache, past, processors):
        by_length = sorted(order, key=lambda row: -new_lengths[row])
        min_tokens, overhead = prefill_block_cost
        planned = padding_blocks([new_lengths[r] for r in by_length], min_tokens=min_tokens, overhead_tokens=overhead)
        if len(planned) > 1:
            order, blocks = by_length, planned
            ends = [past + new_lengths[order[block.start]] for block in blocks]
            input_ids, attention_mask = _block_layout(input_ids, attention_mask, past, new_lengths, order, ends,
                                                      blocks, pad_id)
            cache.batch_select_indices(torch.tensor(order, device=device))
    chunked = (past == 0 and prefill_chunk_tokens is not None and isinstance(cache, GrowingKVCache)
               and device.type == "cpu" and len(budgets) * input_ids.shape[1] > prefill_chunk_tokens)
    if chunked:  # the first chunk allocates the cache; the others fill their rows' windows after add_rows
        step_rows = max(1, prefill_chunk_tokens // input_ids.shape[1])
        blocks = [range(start, min(start + step_rows, len(budgets))) for start in range(0, len(budgets), step_rows)]
        ends = [input_ids.shape[1]] * len(blocks)
    batch, width = input_ids.shape
    longest = max(budgets)
    seq = input_ids.new_full((batch, width + longest), pad_id)  # physical ids, cache-row order
    seq[:, :width] = input_ids
    mask = attention_mask.new_zeros((batch, width + longest))
    mask[:, :width] = attention_mask
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    next_position = attention_mask.long().sum(-1)  # the real tokens so far
    budget = [budgets[row] for row in order]  # per cache row
    tokens: list[list[int]] = [[] for _ in range(batch)]
    log_probs: list[list[float]] | None = None if log_prob_temperature is None else [[] for _ in range(batch)]
    extra: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        extra["logits_to_keep"] = 1
    blocked = len(blocks) > 1
    parts = []
    # one block: the whole batch; else each to its longest row, or (chunked) each chunk of rows
    for number, (block, end) in enumerate(zip(blocks, ends, strict=True)):
        if chunked and number == 1:
            cache.add_rows(batch)  # the first chunk allocated the cache for its rows: room for the others
        if blocked and not (chunked and number == 0):  # a fresh cache's first chunk runs without a window
            cache.row_window(block.start, block.stop, past)
        rows = slice(block.start, block.stop)
        parts.append(model(
            input_ids=input_ids[rows, past:end], attention_mask=attention_mask[rows, :end],
            position_ids=positions[rows, past:end], past_key_values=cache, **extra,
        ).logits[:, -1, :])
    if blocked:
        cache.close_windows()
    logits = torch.cat(parts) if blocked else parts[0]
    _wait_for(device)
    prefill_seconds = time.perf_counter() - started
    timing = {"prefill_tokens": prefill_tokens, "prefill_seconds": prefill_seconds,
              "prefill_positions": sum(len(block) * (end - past) for block, end in zip(blocks, ends, strict=True))}
    decoder = static_decoder(model, cache, processors)
    if decoder is not None:  # the steps on the device: sampled there, captured per bucket (graph_decode)
        outcome = decode_static(model, decoder, cache, logits, attention_mask, next_position, budget, order,
                                eos_ids=eos_ids, processors=processors, do_sample=do_sample,
                                log_prob_temperature=log_prob_temperature)
        result = _static_result(outcome, input_ids, attention_mask, order, pad_id, len(blocks), timing)
        _wait_for(device)
        result.decoding_seconds = time.perf_counter() - started - prefill_seconds
        return result
    fused_step = fused_decode_step(model)  # None: each step through the model's forward
    active, step, row_steps = batch, 0, 0
    while True:
        scores = processors(seq[:active, : width + step], logits.to(dtype=torch.float32))
        if do_sample:  # one uniform per input row, so a row's draws do not depend on the cache-row order
            uniforms = torch.rand(batch)[torch.tensor(order[:active])]
            new = sample_categorical(torch.softmax(scores, dim=-1), uniforms)
        else:
            new = torch.argmax(scores, dim=-1)
        seq[:active, width + step] = new
        if log_probs is not None:
            chosen = token_log_probs(logits, new, log_prob_temperature).tolist()
            for row, value in enumerate(chosen):
                log_probs[order[row]].append(value)
        row_steps += active
        step += 1
        finished = []
        for row, token in enumerate(new.tolist()):
            tokens[order[row]].append(token)
            if token in eos_ids or budget[row] <= step:
                finished.append(row)
        if finished:  # behind the active rows; a finished row's last token is never fed
            seq[torch.tensor(finished, device=seq.device), width + step - 1] = pad_id
            holes, fillers = retire_rows(finished, active)
            _exchange(holes, fillers, (seq, mask, next_position), (order, budget), cache)
            active -= len(finished)
        if active == 0:
            break
        mask[:active, width + step - 1] = 1
        if finished:
            cache.set_active_rows(active)
        step_inputs = {"input_ids": seq[:active, width + step - 1 : width + step].contiguous(),
                       "attention_mask": mask[:active, : width + step],
                       "position_ids": next_position[:active, None].clone()}
        if fused_step is not None:
            logits = fused_step(**step_inputs, cache=cache)
        else:
            logits = model(**step_inputs, past_key_values=cache, **extra).logits[:, -1, :]
        next_position[:active] += 1
    cache.set_active_rows(None)
    length = cache.get_seq_length()
    where = torch.empty(batch, dtype=torch.long)
    where[torch.tensor(order)] = torch.arange(batch)  # cache row of each input row
    where = where.to(device)
    _wait_for(device)
    return DecodeResult(
        tokens=tokens, ids=seq[where, :length], mask=mask[where, :length], cache_rows=order, row_steps=row_steps,
        prefill_blocks=len(blocks), steps=step, log_probs=log_probs, **timing,
        decoding_seconds=time.perf_counter() - started - prefill_seconds,
    )
