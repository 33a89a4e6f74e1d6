"""Warm start: supervised fine-tuning on demonstrations, loss on the model's own tokens only.

A model built from scratch does not speak the agent protocol, so RL would have nothing to
reinforce. Warm start teaches it the format from demonstrations (the scripted policy's
trajectories by default, or a user's own SFT data) before RL.

An example is a token sequence with a loss mask: 1 on tokens the model would have generated
(assistant turns and the ``<|im_end|>`` that closes them), 0 on prompt and observation tokens.
Chat conversations become examples in the rollout's own token layout
(:func:`spader_pipeline.agent.tokens.examples_from_dialogues`, VERL's continuous-token builder), so
the model is trained on exactly the token boundaries it sees in RL and under VERL; this module only
sees token ids.

Three things make the loop fast on CPU (measured in ``benchmarks/bench_training_warm_start.py``):

- **output layer only where there is loss**: the decoder runs on every position, but the
  ``hidden × vocab`` projection and the softmax run only on the ~5% of positions with loss;
- **length bucketing**: batches hold examples of similar length, so little compute goes to padding;
- **bf16 autocast** for the matrix multiplications (weights and optimizer state stay fp32).

Off the CPU a step's cost is its kernel launches more than its arithmetic (SmolLM2's step: ~4,000
operations, one demonstration of ~930 tokens). With the bottom blocks frozen (``trainable_layers``)
their output on a demonstration never changes, so the frozen blocks run once per demonstration, many
demonstrations a forward, and each step runs the trained blocks from those *boundary states*
(:mod:`spader_pipeline.modeling.boundary`, as the RL update does from the rollout's): ~2,150 operations
a step (``boundary_states``; ``benchmarks/bench_sft_boundary.py`` times both loops). On a CPU a step is
its arithmetic, which batching the frozen blocks does not reduce, so the CPU keeps the plain forward.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

import torch
import torch.nn.functional as F

from spader_pipeline.modeling.batching import token_budget_runs
from spader_pipeline.modeling.boundary import (
    bottom_block_states,
    decoder_blocks,
    first_trained_block,
    supports_boundary,
    top_block_states,
)
from spader_pipeline.modeling.shared_prefix import decoder_states, use_shared_prefix

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTExample:
    """One training sequence: ``input_ids`` and a same-length 0/1 ``loss_mask``."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError("input_ids and loss_mask must have the same length")


def example_from_tokens(prompt_ids: Sequence[int], response_ids: Sequence[int], response_mask: Sequence[int]) -> SFTExample:
    """An example from a token-level trajectory (prompt context + response with its mask)."""
    return SFTExample(
        tuple(int(i) for i in prompt_ids) + tuple(int(i) for i in response_ids),
        (0,) * len(prompt_ids) + tuple(int(m) for m in response_mask),
    )


@dataclass
class WarmStartConfig:
    """Settings of :func:`train_sft`."""

    max_steps: int = 600
    """optimizer steps (the loop also stops at ``max_seconds``)"""
    max_seconds: float | None = None
    """wall-clock budget in seconds; ``None`` for no limit"""
    batch_tokens: int = 8192
    """padded tokens per batch (examples per batch = batch_tokens // bucket length, at least 1)"""
    learning_rate: float = 1e-3
    """peak AdamW learning rate"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    warmup_steps: int = 20
    """linear warm-up steps, then cosine decay to 10% of the peak"""
    schedule_steps: int | None = None
    """horizon of the cosine decay (``None``: ``max_steps``); a run that stops at ``max_steps <
    schedule_steps`` reproduces the first steps of a longer run exactly (a measured stopping step)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    bf16: bool | str = "auto"
    """bf16 autocast for the forward pass: ``"auto"`` = on for CUDA; on a CPU by its flags
    (:mod:`spader_pipeline.modeling.precision`: CPUs without native bf16 units, such as
    AVX2-only machines, run bf16 autocast several times slower than fp32)"""
    trainable_layers: int | None = None
    """train only the top this-many decoder blocks (+ final norm); ``None`` = the whole model
    (see :func:`spader_pipeline.modeling.base_model.train_top_layers`)"""
    boundary_states: bool | str = "auto"
    """run the frozen blocks below ``trainable_layers`` once per demonstration, batched, and each step
    from their output (the module's docstring): ``"auto"`` = off the CPU (where a step is launch-bound),
    ``true`` anywhere, ``false`` never"""
    boundary_tokens: int = 32768
    """padded tokens per forward of the frozen blocks; the boundary states of at most this many
    demonstration tokens (the next steps' batches) are held at once"""
    shared_prefix: bool | str = "auto"
    """a step of several demonstrations encodes the instruction they share once: ``"auto"`` = on a
    CPU, not on a GPU (:func:`~spader_pipeline.modeling.shared_prefix.use_shared_prefix`)"""
    max_length: int = 1024
    """examples are truncated to this many tokens"""
    seed: int = 0
    """shuffling and initialisation seed"""
    log_every: int = 20
    """log the loss every this many steps"""
    extra: dict = field(default_factory=dict)
    """ignored; keeps unknown keys from YAML"""

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.batch_tokens < 1 or self.learning_rate <= 0:
            raise ValueError("max_steps >= 0, batch_tokens >= 1 and learning_rate > 0 are required")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if self.boundary_states not in (True, False, "auto") or self.boundary_tokens < 1:
            raise ValueError(f"boundary_states is true, false or 'auto' (got {self.boundary_states!r}); "
                             f"boundary_tokens >= 1 (got {self.boundary_tokens})")
        if self.shared_prefix not in (True, False, "auto"):
            raise ValueError(f"shared_prefix is true, false or 'auto' (got {self.shared_prefix!r})")


def length_buckets(examples: Sequence[SFTExample], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Group example indices into batches of similar length (≤ ``batch_tokens`` padded tokens).

    Examples are sorted by length, cut into consecutive batches, and the batch order shuffled.
    """
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].input_ids), rng.random()))
    runs = token_budget_runs([len(examples[i].input_ids) for i in order], batch_tokens)
    batches = [order[run.start : run.stop] for run in runs]
    rng.shuffle(batches)
    return batches


def collate(examples: Sequence[SFTExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to ``(input_ids, attention_mask, loss_mask)``, each ``[B, T]``."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    loss = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        attn[row, :n] = 1
        loss[row, :n] = torch.tensor(e.loss_mask)
    return ids, attn, loss


def masked_lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, *,
                   boundary: torch.Tensor | None = None, first_block: int = 0,
                   shared_prefix: bool = True) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over positions whose *target* has ``loss_mask == 1``.

    Runs the decoder body on all positions, with ``shared_prefix`` the instruction every demonstration
    starts with only once (:func:`~spader_pipeline.modeling.shared_prefix.decoder_states`), and the output layer only
    on the positions that predict a target token. Shapes: all inputs ``[B, T]``. With ``boundary``
    (``[B, T, H]``, the output of block ``first_block - 1``: :func:`frozen_block_states`) only the
    blocks from ``first_block`` up run (:func:`~spader_pipeline.modeling.boundary.top_block_states`).
    Returns the loss and the number of target tokens.
    """
    if boundary is None:
        hidden = decoder_states(model, input_ids, attention_mask, shared_prefix=shared_prefix)  # [B, T, H]
    else:
        hidden = top_block_states(model, boundary, input_ids, attention_mask, first_block=first_block,
                                  shared_prefix=shared_prefix)
    select = loss_mask[:, 1:].bool()  # position t predicts token t+1
    states = hidden[:, :-1][select]  # [N, H]
    targets = input_ids[:, 1:][select]  # [N]
    logits = model.lm_head(states).float()  # [N, V]
    return F.cross_entropy(logits, targets), int(targets.numel())


def boundary_block(model, config: WarmStartConfig, device: torch.device) -> int | None:
    """The first trained block when the SFT steps start from the frozen blocks' states
    (``config.boundary_states``, the blocks ``config.trainable_layers`` leaves frozen, a model
    :func:`~spader_pipeline.modeling.boundary.supports_boundary` takes), else ``None``."""
    wanted = config.boundary_states is True or (config.boundary_states == "auto" and device.type != "cpu")
    first = first_trained_block(model, config.trainable_layers) if wanted else None
    return first if first is not None and supports_boundary(model, first) else None


@torch.no_grad()
def frozen_block_states(model, examples: Sequence[SFTExample], indices: Sequence[int], *, first_block: int,
                        pad_id: int, max_tokens: int, bf16: bool | str) -> dict[int, torch.Tensor]:
    """The boundary states of ``examples[i]`` for each ``i`` in ``indices``: ``{i: [len, H]}``, the output
    of block ``first_block - 1`` at every position of the example, on the model's device.

    The examples run length-sorted, in forwards of at most ``max_tokens`` padded tokens
    (:func:`~spader_pipeline.modeling.boundary.bottom_block_states`), under the SFT's autocast.
    """
    device = next(model.parameters()).device
    unique = sorted(set(indices), key=lambda i: len(examples[i].input_ids))
    states: dict[int, torch.Tensor] = {}
    for run in token_budget_runs([len(examples[i].input_ids) for i in unique], max_tokens):
        chunk = unique[run.start : run.stop]
        ids, attn, _ = (t.to(device) for t in collate([examples[i] for i in chunk], pad_id))
        with autocast(device, bf16):
            hidden = bottom_block_states(model, ids, attn, first_block=first_block)  # [b, T, H]
        for row, i in enumerate(chunk):
            states[i] = hidden[row, : len(examples[i].input_ids)]
    return states


def planned_batches(examples: Sequence[SFTExample], config: WarmStartConfig, rng: random.Random) -> Iterator[list[int]]:
    """The SFT's batches in order, at most ``config.max_steps``: epoch after epoch of
    :func:`length_buckets`, each epoch's order drawn from ``rng`` when it starts."""

    def epochs() -> Iterator[list[int]]:
        while True:
            yield from length_buckets(examples, config.batch_tokens, rng)

    return islice(epochs(), config.max_steps)


def _with_boundary_states(batches: Iterator[list[int]], examples: Sequence[SFTExample], budget: int,
                          compute: Callable[[list[int]], dict[int, torch.Tensor]]) -> Iterator[
                              tuple[list[int], dict[int, torch.Tensor]]]:
    """Each batch with its examples' boundary states, computed by ``compute(indices)`` for as many of
    the next batches as hold ``budget`` tokens together (at least one batch)."""
    window: list[list[int]] = []
    size = 0
    for batch in batches:
        tokens = sum(len(examples[i].input_ids) for i in batch)
        if window and size + tokens > budget:
            states = compute([i for b in window for i in b])
            yield from ((b, states) for b in window)
            window, size = [], 0
        window.append(batch)
        size += tokens
    if window:
        states = compute([i for b in window for i in b])
        yield from ((b, states) for b in window)


def train_sft(model, examples: Sequence[SFTExample], config: WarmStartConfig, *, pad_id: int, on_log=None) -> dict[str, float]:
    """Fine-tune ``model`` in place on ``examples``; return summary metrics.

    ``on_log(step, metrics)`` is called every ``config.log_every`` steps (e.g. MLflow logging).
    """
    examples = [e for e in examples if sum(e.loss_mask[1:]) > 0]
    if not examples:
        raise ValueError("warm start has no example with a trainable token")
    examples = [SFTExample(e.input_ids[: config.max_length], e.loss_mask[: config.max_length]) for e in examples]
    from spader_pipeline.modeling.base_model import train_top_layers
    from spader_pipeline.modeling.precision import resolve_bf16

    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    trainable = train_top_layers(model, config.trainable_layers)
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(config.warmup_steps, config.schedule_steps or config.max_steps))
    device = next(model.parameters()).device
    bf16 = resolve_bf16(config.bf16, device, model)
    first_block = boundary_block(model, config, device)
    shared = use_shared_prefix(config.shared_prefix, device)
    boundary_seconds = 0.0

    def compute(indices: list[int]) -> dict[int, torch.Tensor]:
        nonlocal boundary_seconds
        began = time.perf_counter()
        states = frozen_block_states(model, examples, indices, first_block=first_block, pad_id=pad_id,
                                     max_tokens=config.boundary_tokens, bf16=bf16)
        boundary_seconds += time.perf_counter() - began
        return states

    batches = planned_batches(examples, config, rng)
    if first_block is None:
        steps = ((batch, None) for batch in batches)
    else:
        logger.info("warm start: blocks 0-%d run once per demonstration; the steps train blocks %d-%d from "
                    "their states", first_block - 1, first_block, len(decoder_blocks(model)) - 1)
        steps = _with_boundary_states(batches, examples, config.boundary_tokens, compute)
    model.train()
    start = time.perf_counter()
    step, tokens, seen, loss_sum, loss_n = 0, 0, 0, 0.0, 0
    last_loss = float("nan")
    for batch, states in steps:
        if config.max_seconds and time.perf_counter() - start > config.max_seconds:
            break
        ids, attn, loss_mask = (t.to(device) for t in collate([examples[i] for i in batch], pad_id))
        boundary = None
        if states is not None:
            boundary = torch.nn.utils.rnn.pad_sequence([states[i] for i in batch], batch_first=True)  # [B, T, H]
        with autocast(ids.device, bf16):
            loss, n_targets = masked_lm_loss(model, ids, attn, loss_mask, boundary=boundary,
                                             first_block=first_block or 0, shared_prefix=shared)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
        optimizer.step()
        schedule.step()
        step += 1
        tokens += sum(len(examples[i].input_ids) for i in batch)
        seen += len(batch)
        last_loss = float(loss.detach())
        loss_sum, loss_n = loss_sum + last_loss, loss_n + 1
        if on_log is not None and step % config.log_every == 0:
            on_log(step, {"loss": loss_sum / loss_n, "lr": schedule.get_last_lr()[0]})
            loss_sum, loss_n = 0.0, 0
    model.eval()
    seconds = time.perf_counter() - start
    return {
        "steps": float(step),
        "examples_seen": float(seen),
        "final_loss": last_loss,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "boundary_states": float(first_block is not None),
        "boundary_seconds": boundary_seconds,
        "shared_prefix": float(shared),
    }


def autocast(device: torch.device, bf16: bool | str):
    """A bf16 autocast context for ``device`` (``bf16="auto"``: on for CUDA only; resolve it first
    with :func:`spader_pipeline.modeling.precision.resolve_bf16` to decide for a CPU)."""
    enabled = device.type == "cuda" if bf16 == "auto" else bool(bf16)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
