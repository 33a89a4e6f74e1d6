"""Should the matrix multiplications run under bf16 autocast? Decided per machine, not per hour.

On CUDA bf16 autocast is always faster. On CPUs it depends on the hardware: with native bf16
instructions (AVX-512 BF16 / AMX) it can be 2–3× faster than fp32, without them it has been
measured many times *slower* (docs/results.md). ``bf16: auto`` therefore reads the CPU's flags
(``/proc/cpuinfo``): without a bf16 unit it is off, with one it is on. Where the flags cannot be read,
a short probe decides — forward + backward of a SwiGLU MLP block of the model's width, fp32 vs bf16
autocast, the minimum of interleaved repeats after a warm-up — once per process and width.
The flags come first because a timing probe follows the machine's load: a probe beside another
process once turned bf16 off for one stage of a chain and on for the next, so their numbers differed
from an idle run's. Weights and optimizer state stay fp32 either way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator

import torch

from spader_pipeline.bf16_switch import BF16_FLAGS, FORCE_ENV, FORCE_VALUES, cpu_has_bf16, forced_bf16
from spader_pipeline.modeling.packed_linear import packed_bf16_linears

__all__ = ["BF16_FLAGS", "FORCE_ENV", "FORCE_VALUES", "bf16_faster_on_cpu", "bf16_inference", "cpu_has_bf16",
           "forced_bf16", "resolve_bf16"]

logger = logging.getLogger(__name__)

# bf16 must beat fp32 by this factor to be chosen by the probe.
MARGIN = 0.9


def resolve_bf16(setting: bool | str, device: torch.device | str, model: torch.nn.Module | None = None) -> bool:
    """``True``/``False`` as given; ``"auto"``: :func:`forced_bf16` where set, else CUDA → on,
    CPU → :func:`cpu_has_bf16`, else the probe's verdict."""
    if setting != "auto":
        return bool(setting)
    forced = forced_bf16()
    if forced is not None:
        logger.info("bf16 autocast %s: forced by %s", "on" if forced else "off", FORCE_ENV)
        return forced
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    native = cpu_has_bf16()
    if native is not None:
        return native
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 512) or 512)
    inner = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
    return bf16_faster_on_cpu(hidden, inner)


@contextlib.contextmanager
def bf16_inference(model: torch.nn.Module, device_type: str, enabled: bool) -> Iterator[None]:
    """No-grad inference under bf16 autocast (``enabled``), each fp32 weight cast to bf16 once for the
    whole block instead of at every forward.

    Autocast keeps its bf16 copy of a weight until the context ends only for leaf tensors that require
    grad. A frozen block's weights (``requires_grad`` off: the blocks RL does not train) were otherwise
    cast again at every decoding step, reading and writing every frozen weight per generated token:
    the greedy validation of one question at a time ran 1.5× slower for it (docs/performance.md). Inside
    ``no_grad`` a weight that requires grad builds no graph, so the frozen weights are marked as requiring
    grad for the block and restored after; the casts, hence the tokens, are the same bits. On a CPU with
    a bf16 unit the linear layers also read their weights in oneDNN's layout, packed once
    (:func:`~spader_pipeline.modeling.packed_linear.packed_bf16_linears`: the same products, bit for
    bit). Without ``enabled``: plain ``no_grad``.
    """
    if not enabled:
        with torch.no_grad():
            yield
        return
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]
    try:
        for weight in frozen:
            weight.requires_grad_(True)
        with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16), packed_bf16_linears(model):
            yield
    finally:
        for weight in frozen:
            weight.requires_grad_(False)



@functools.lru_cache(maxsize=8)
def bf16_faster_on_cpu(hidden: int, inner: int, rows: int = 64, repeats: int = 5) -> bool:
    """Probe: is a forward+backward of a ``hidden → inner → hidden`` SwiGLU block on ``rows``
    tokens faster under bf16 autocast than in fp32 on this CPU? (~0.1–1 s, once per size.)

    One warm-up of each first (bf16's first call builds its kernels), then ``repeats`` interleaved
    runs of each; the minimum of each is compared, since load only ever adds time."""
    gen = torch.Generator().manual_seed(0)
    w_gate = (torch.randn(hidden, inner, generator=gen) / hidden**0.5).requires_grad_()
    w_up = (torch.randn(hidden, inner, generator=gen) / hidden**0.5).requires_grad_()
    w_down = (torch.randn(inner, hidden, generator=gen) / inner**0.5).requires_grad_()
    x = torch.randn(rows, hidden, generator=gen)

    def run(enabled: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            y = (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down
        y.float().square().mean().backward()
        for w in (w_gate, w_up, w_down):
            w.grad = None
        return time.perf_counter() - start

    for enabled in (False, True):
        run(enabled)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for enabled in (False, True):
            times[enabled].append(run(enabled))
    fp32, bf16 = min(times[False]), min(times[True])
    faster = bf16 < MARGIN * fp32
    logger.info("bf16 probe (hidden %d, inner %d): fp32 %.1f ms, bf16 autocast %.1f ms (minimum of %d) → bf16 %s",
                hidden, inner, fp32 * 1e3, bf16 * 1e3, repeats, "on" if faster else "off")
    return faster
