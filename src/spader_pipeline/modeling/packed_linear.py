"""bf16 weights in oneDNN's own layout for CPU inference: the same products, each weight read once per step.

Under CPU bf16 autocast every ``nn.Linear`` hands oneDNN an fp32 input and the weight's bf16 copy,
and oneDNN first reorders that weight into its blocked layout, at every call. At one decoding row the
reorder costs as much as the product itself: SmolLM2-135M's projections and head at one row took
18.5 ms a pass on one thread against 9.8 ms from weights reordered once
(``torch.ops.mkldnn._reorder_linear_weight``, the layout ``torch.compile``'s frozen CPU graphs use;
docs/performance.md). :func:`packed_bf16_linears` gives a model's linear layers that layout for the
length of an inference block. The product is oneDNN's bf16 product of the same bf16 values with fp32
sums, as autocast's is; whether it sums them in the same order is the machine's
(:func:`packing_matches_autocast`): on an AVX-512 bf16 AMD it does at any number of rows (the same bits);
on an Intel Xeon with AMX the packed layout blocks the sums of more than 32 rows otherwise, and a few
outputs in 10^5 round their last bf16 bit the other way (``tests/modeling/test_modeling_packed_linear.py``
holds both). Packing is used wherever the CPU has a bf16 unit: without it the fused decoding step does not
apply, and a step through the model's own forward costs up to twice as much (docs/performance.md); the
trainer's update computes what it trains on with autocast's own products either way (from the rollout's
boundary states, the frozen blocks' outputs as the packed products rounded them).

The reordered copies are kept per model between blocks and re-made only for a weight that changed since
(its tensor's version counter, which every in-place write bumps: an optimizer step, ``copy_``,
``load_state_dict``), so a training loop that updates its top blocks re-packs only those. They cost
one bf16 copy of the linear weights (270 MB for SmolLM2-135M) for the model's lifetime.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from spader_pipeline.bf16_switch import cpu_has_bf16

__all__ = ["PACK_WEIGHTS", "packed_bf16_linears", "packed_product", "packed_weights", "packing_available",
           "packing_matches_autocast"]

logger = logging.getLogger(__name__)

#: pack where available (benchmarks set it off to time autocast's own path in the same process)
PACK_WEIGHTS = True

#: per model: linear modules packed as one weight → (each weight's (version, data pointer), packed weight,
#: bf16 bias or None)
_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[torch.nn.Linear, ...], tuple[tuple, torch.Tensor, Any]]] = (
    weakref.WeakKeyDictionary())


def packing_available() -> bool:
    """Whether this torch and CPU pack bf16 weights for oneDNN: the ops exist, oneDNN is built in, and the
    CPU has a bf16 unit (where it lacks one, bf16 autocast is off by default and oneDNN would emulate)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise") and cpu_has_bf16() is True)


#: the shapes :func:`packing_matches_autocast` checks (SmolLM2's k/v, gate and down projections) and the rows
#: (a decoding step's to a prefill's); an AMX Xeon's packed sums part from autocast's above 32 rows
MATCH_CHECK_SHAPES = ((192, 576), (1536, 576), (576, 1536))
MATCH_CHECK_ROWS = (1, 16, 33, 48, 64, 300)


@functools.lru_cache(maxsize=1)
def packing_matches_autocast() -> bool:
    """Whether packed products are autocast's bit for bit on this machine, checked once per process on
    :data:`MATCH_CHECK_SHAPES` at :data:`MATCH_CHECK_ROWS`. oneDNN picks how it blocks a product's sums by
    the CPU's instruction set (AMX, AVX-512) and the shape; where the packed layout's blocking differs, a few
    outputs in 10^5 round their last bf16 bit the other way. Tests that compare packed products with
    autocast's ask this to choose ``==`` or that bound."""
    if not packing_available():
        return False
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in MATCH_CHECK_SHAPES:
        weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        for rows in MATCH_CHECK_ROWS:
            x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
            if not torch.equal(packed_product(x, (packed, None)), torch.nn.functional.linear(x, weight)):
                logger.info("oneDNN's packed bf16 products round a few outputs otherwise than autocast's here")
                return False
    return True


def packed_product(x: torch.Tensor, weight_and_bias: tuple[torch.Tensor, Any]) -> torch.Tensor:
    """``x @ W.T + b`` from a packed bf16 weight and bf16 bias (:func:`packed_weights`): ``x`` ``[..., in]``
    of any dtype, cast to bf16 as autocast casts it; returns bf16 ``[..., out]``."""
    weight, bias = weight_and_bias
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, bias, "none", [], "")


def _packable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and weight is not None and weight.dim() == 2
            and weight.device.type == "cpu" and weight.dtype == torch.float32)


def packed_weights(model: torch.nn.Module, modules: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, Any]:
    """The packed bf16 weight of ``modules`` stacked along their outputs (one product computes all of
    them: ``[..., sum of out]``, in the order given) and their bf16 bias (``None`` when none has one),
    kept for ``model`` and re-made when any of the weights changed since. One module: its own weight,
    the copy the layer reads inside :func:`packed_bf16_linears`."""
    cache = _PACKED.setdefault(model, {})
    key = tuple((m.weight._version, m.weight.data_ptr()) for m in modules)
    entry = cache.get(modules)
    if entry is None or entry[0] != key:
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), 1)
        biases = [m.bias for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                              for b, m in zip(biases, modules, strict=True)]).to(torch.bfloat16)
        entry = cache[modules] = (key, packed, bias)
    return entry[1], entry[2]


@contextlib.contextmanager
def packed_bf16_linears(model: torch.nn.Module, enabled: bool | None = None) -> Iterator[int]:
    """While active, ``model``'s fp32 CPU ``nn.Linear`` layers compute ``x @ W.T + b`` from bf16 weights
    packed for oneDNN: under CPU bf16 autocast and without grad, where autocast would compute the same
    products of the same bf16 values (other calls, e.g. with grad enabled, run the layer as it is).

    Yields the number of layers packed (0 where :func:`packing_available` is false, or ``enabled``, by
    default :data:`PACK_WEIGHTS`, is false).
    Inputs ``[..., in]`` of any dtype (cast to bf16, as autocast casts them); outputs bf16 ``[..., out]``.
    """
    if not (PACK_WEIGHTS if enabled is None else enabled) or not packing_available():
        yield 0
        return
    layers = [m for m in model.modules() if _packable(m)]
    for module in layers:
        module.forward = _packed_forward(model, module)  # an instance attribute: removed below
    try:
        yield len(layers)
    finally:
        for module in layers:
            module.__dict__.pop("forward", None)


def _packed_forward(model: torch.nn.Module, module: torch.nn.Linear):
    original = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() or not torch.is_autocast_enabled("cpu")
                or torch.get_autocast_dtype("cpu") != torch.bfloat16 or x.device.type != "cpu"):
            return original(x)
        return packed_product(x, packed_weights(model, (module,)))

    return forward
