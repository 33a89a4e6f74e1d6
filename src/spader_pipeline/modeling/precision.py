"""Should the matrix multiplications run under bf16 autocast? Measured, not assumed.

On CUDA bf16 autocast is always faster. On CPUs it depends on the hardware: with native bf16
instructions (AVX-512 BF16 / AMX) it can be 2–3× faster than fp32, without them it has been
measured many times *slower* (docs/results.md). ``bf16: auto`` therefore runs a short probe —
forward + backward of a SwiGLU MLP block of the model's width, fp32 vs bf16 autocast, median of a
few repeats — once per process and width, and enables autocast only where it wins clearly.
Weights and optimizer state stay fp32 either way.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time

import torch

logger = logging.getLogger(__name__)

# bf16 must beat fp32 by this factor to be chosen (probe noise on a loaded machine).
MARGIN = 0.9


def resolve_bf16(setting: bool | str, device: torch.device | str, model: torch.nn.Module | None = None) -> bool:
    """``True``/``False`` as given; ``"auto"``: CUDA → on, CPU → the probe's verdict."""
    if setting != "auto":
        return bool(setting)
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 512) or 512)
    inner = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
    return bf16_faster_on_cpu(hidden, inner)


@functools.lru_cache(maxsize=8)
def bf16_faster_on_cpu(hidden: int, inner: int, rows: int = 64, repeats: int = 3) -> bool:
    """Probe: is a forward+backward of a ``hidden → inner → hidden`` SwiGLU block on ``rows``
    tokens faster under bf16 autocast than in fp32 on this CPU? (~0.1–1 s, once per size.)"""
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

    times = {False: [], True: []}
    warm = {enabled: run(enabled) for enabled in (False, True)}
    if warm[True] > 2 * warm[False]:  # clearly slower (no bf16 units): do not spend more time
        logger.info("bf16 probe (hidden %d, inner %d): fp32 %.1f ms, bf16 autocast %.1f ms → bf16 off",
                    hidden, inner, warm[False] * 1e3, warm[True] * 1e3)
        return False
    for _ in range(repeats):  # interleaved, so a load spike hits both
        for enabled in (False, True):
            times[enabled].append(run(enabled))
    fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
    faster = bf16 < MARGIN * fp32
    logger.info("bf16 probe (hidden %d, inner %d): fp32 %.1f ms, bf16 autocast %.1f ms → bf16 %s",
                hidden, inner, fp32 * 1e3, bf16 * 1e3, "on" if faster else "off")
    return faster
