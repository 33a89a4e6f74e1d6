"""One decoding step of a Llama-family decoder as plain tensor code over fused, packed bf16 weights.

At one decoding row a step through transformers' modules is mostly not arithmetic: the products read
the weights in a third of the step, and the rest goes to some thousands of small operator calls and the
Python of the modules, the mask functions and the cache around them (docs/performance.md). llama.cpp
runs the same step as one graph. :class:`FusedDecodeStep` is that step for the decoders we run on a
CPU (``llama``: SmolLM2; ``qwen3``), written once as tensor code:

* the query, key and value projections are one product, and so are the gate and up projections
  (:func:`~spader_pipeline.modeling.packed_linear.packed_weights`: their weights stacked, packed
  for oneDNN once); each output column is still its own dot product over the same bf16 values, so
  the result equals the separate products bit for bit;
* the rotary embedding is applied to the query and key heads together, with the sign of
  ``rotate_half`` carried by a pre-signed sine (the same products: negation is exact);
* no mask is built when no row is padded; a padded row's mask is the attention mask itself (one query
  position attends to every cached one).

It computes what the model's forward computes under CPU bf16 autocast with the ``sdpa_gqa`` attention
(:mod:`~spader_pipeline.modeling.attention`), operation for operation: RMSNorm in fp32 as the model's
norm modules write it, the projections as oneDNN bf16 products, the rotary embedding in fp32, the
attention in fp32 over the cache, the residual stream in fp32. Tokens and log-probabilities are the
same bits (``tests/modeling/test_modeling_decode_step.py``). :func:`fused_decode_step` gives the step
only where that holds; everywhere else (another family, another attention, a GPU, no bf16 unit,
gradients, a forward hook it does not know) it gives ``None`` and the caller runs the model.

Where the C++ extension builds (:mod:`~spader_pipeline.modeling.native_step`) and the cache is a
:class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache` over bf16 keys and values, the step's
blocks run in C++ as one call: the same operations rounded the same way, so the same bits.

Which of these paths a machine decodes with is :func:`decoding_path`'s answer, recorded with a run
(the method run's MLflow parameters, the checkpoints' settings, the portable report's environment).

A rollout that collects the boundary states (:func:`~spader_pipeline.modeling.boundary.
capture_block_output`) registers the block here (:data:`CAPTURED_BLOCK`), and the step appends that
block's output to the cache's ``states`` as the hook would.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from spader_pipeline.modeling import decode_attention as attention_settings
from spader_pipeline.modeling import native_step, packed_linear, triton_attention
from spader_pipeline.modeling.attention import NAME as GQA_ATTENTION
from spader_pipeline.modeling.decode_attention import decode_attention
from spader_pipeline.modeling.device import resolve_device
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.native_step import native_available
from spader_pipeline.modeling.packed_linear import packed_product, packed_weights, packing_available
from spader_pipeline.modeling.precision import resolve_bf16
from spader_pipeline.modeling.static_cache import static_attention_name, static_kernels_name, static_step_name

__all__ = ["CAPTURED_BLOCK", "FUSED_DECODE_STEP", "FusedDecodeStep", "SUPPORTED_MODEL_TYPES", "decoding_path",
           "fused_decode_step", "fused_decode_step_applies"]

#: run decoding steps through :class:`FusedDecodeStep` where it applies (benchmarks switch it off to time
#: the model's own forward in the same process)
FUSED_DECODE_STEP = True
#: decoder families whose block is RMSNorm → attention (optionally RMSNorm on query and key heads, as
#: Qwen3) → residual → RMSNorm → SwiGLU MLP → residual, with one rotary embedding
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen3"})
#: per model: (the block whose output the cache's ``states`` collects, the id of the forward hook that
#: collects it), while :func:`~spader_pipeline.modeling.boundary.capture_block_output` is active
CAPTURED_BLOCK: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``norm``'s forward (``LlamaRMSNorm``/``Qwen3RMSNorm``) written out: fp32 statistics, the
    normalised values back in the input's dtype, times the fp32 weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def rotated_query_keys(qkv: torch.Tensor, heads: int, kv_heads: int, q_norm: Any, k_norm: Any, cos: torch.Tensor,
                       signed_sin: torch.Tensor) -> torch.Tensor:
    """A step's query and key heads ``[n, H + H_kv, D]`` from its q|k|v product ``[n, H + 2 H_kv, D]``: normed
    over each head where the family does (Qwen3's ``q_norm``/``k_norm``, before the rotation), then rotated
    (``cos``, and ``sin`` with ``rotate_half``'s sign on its first half: ``[n, 1, D]``)."""
    half = qkv.shape[-1] // 2
    if q_norm is not None:
        qk = torch.cat((_rms_norm(qkv[:, :heads], q_norm), _rms_norm(qkv[:, heads : heads + kv_heads], k_norm)), dim=1)
    else:
        qk = qkv[:, : heads + kv_heads]
    return qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * signed_sin


@functools.lru_cache(maxsize=8)
def _fused_norm_matches(width: int, device: str = "cpu") -> bool:
    """Whether ``torch.rms_norm`` on fp32 rows of ``width`` equals :func:`_rms_norm` bit for bit on
    ``device`` (checked once per process, width and device): one call instead of six on the residual
    stream's norms. In this torch it is the same operations in C++ on a CPU; a version with a kernel that
    sums in another order (a fused GPU kernel) fails the check, and the norms keep the written-out form."""
    generator = torch.Generator().manual_seed(0)
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.randn(width, generator=generator).to(device), 1e-5
    x = (torch.randn(5, width, generator=generator) * 3).to(device)
    return torch.equal(torch.rms_norm(x, (width,), norm.weight, 1e-5), _rms_norm(x, norm))


def _residual_norm(norm: torch.nn.Module, fused: bool):
    """The norm of an fp32 residual row: ``torch.rms_norm`` where :func:`_fused_norm_matches`, else the
    model's formula."""
    if fused:
        weight, shape, eps = norm.weight, (norm.weight.shape[0],), norm.variance_epsilon
        return lambda x: torch.rms_norm(x, shape, weight, eps)
    return lambda x: _rms_norm(x, norm)


class FusedDecodeStep:
    """A decoding step of ``model`` (one new token per row): ``step(input_ids [n, 1], attention_mask
    [n, L], position_ids [n, 1], cache) → logits [n, V]`` (bf16, the last position's, as
    ``model(...).logits[:, -1]``), the cache extended by one position per row as the forward would.

    ``L`` = the cached positions + 1; ``cache``: a ``DynamicCache`` (``update(keys, values, layer)``),
    e.g. a :class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache` with its active rows set. Made by
    :func:`fused_decode_step`, which also checks when it may run; the packed weights are looked up
    when it is made (re-packed where a weight changed), so make one per decoding call.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        config, body = model.config, model.model
        self.body = body
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        fused_norm = _fused_norm_matches(config.hidden_size)
        self.layers = []  # per block: what a step reads, looked up once (a module attribute is a dict walk)
        for block in body.layers:
            attention, mlp = block.self_attn, block.mlp
            self.layers.append((
                _residual_norm(block.input_layernorm, fused_norm),
                packed_weights(model, (attention.q_proj, attention.k_proj, attention.v_proj)),
                getattr(attention, "q_norm", None), getattr(attention, "k_norm", None), attention.scaling,
                packed_weights(model, (attention.o_proj,)),
                _residual_norm(block.post_attention_layernorm, fused_norm),
                packed_weights(model, (mlp.gate_proj, mlp.up_proj)),
                packed_weights(model, (mlp.down_proj,)),
            ))
        self.final_norm = _residual_norm(body.norm, fused_norm)
        self.head = packed_weights(model, (model.lm_head,))
        self.captured = CAPTURED_BLOCK.get(model, (None, None))[0]
        self.native = self._native_arguments(model) if native_step.NATIVE_STEP and native_available() else None

    def _native_arguments(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """The C++ step's weights, norms and constants (:mod:`~spader_pipeline.modeling.native_step`),
        or ``None`` where it does not cover this model: a bias, or norms or scales that differ by block."""
        blocks = self.body.layers
        if any(bias is not None for layer in self.layers for _, bias in (layer[1], layer[5], layer[7], layer[8])):
            return None
        head_norms = self.layers[0][2] is not None
        residual = [norm for block in blocks for norm in (block.input_layernorm, block.post_attention_layernorm)]
        per_head = [norm for layer in self.layers for norm in (layer[2], layer[3])] if head_norms else []
        if (len({norm.variance_epsilon for norm in [*residual, self.body.norm]}) != 1
                or len({norm.variance_epsilon for norm in per_head}) > 1 or len({layer[4] for layer in self.layers}) != 1):
            return None
        norms = []
        for block, layer in zip(blocks, self.layers, strict=True):
            norms += [block.input_layernorm.weight, block.post_attention_layernorm.weight]
            norms += [layer[2].weight, layer[3].weight] if head_norms else []
        return {
            "weights": [w for layer in self.layers for w, _ in (layer[1], layer[5], layer[7], layer[8])] + [self.head[0]],
            "norms": [*norms, self.body.norm.weight], "heads": self.heads, "kv_heads": self.kv_heads,
            "eps": self.body.norm.variance_epsilon, "head_norm_eps": per_head[0].variance_epsilon if head_norms else 0.0,
            "scaling": self.layers[0][4], "head_norms": head_norms,
        }

    def _native_cache(self, cache: Any) -> bool:
        """Whether the C++ step can write ``cache`` in place: a :class:`GrowingKVCache` holding bf16 keys
        and values for every block."""
        layers = getattr(cache, "layers", None)
        if not isinstance(cache, GrowingKVCache) or len(layers) != len(self.layers):
            return False
        first = layers[0]
        return (first._key_buffer is not None and first._key_buffer.dtype == torch.bfloat16
                and first._value_buffer.dtype == torch.bfloat16)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: Any) -> torch.Tensor:
        rows, heads, kv_heads, dim = input_ids.shape[0], self.heads, self.kv_heads, self.head_dim
        half = dim // 2
        x = F.embedding(input_ids[:, 0], self.body.embed_tokens.weight)  # [n, hidden] fp32: the residual
        cos, sin = self.body.rotary_emb(x, position_ids)  # [n, 1, D] fp32
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's sign, on sin
        mask = None if bool(attention_mask.all()) else attention_mask.bool()
        states = getattr(cache, "states", None) if self.captured is not None else None
        if self.native is not None and self._native_cache(cache):
            keys, values = cache.reserve(1)
            logits, state = torch.ops.spader_native.decode_step(
                x, cos, signed_sin, key_caches=keys, value_caches=values, mask=mask,
                captured=self.captured if states is not None else -1, **self.native)
            if states is not None:
                states.append(state[:, None])
            return logits
        for index, (norm_in, qkv_weight, q_norm, k_norm, scaling, o_weight, norm_mid, gate_up_weight,
                    down_weight) in enumerate(self.layers):
            qkv = packed_product(norm_in(x), qkv_weight).view(rows, heads + 2 * kv_heads, dim)
            qk = rotated_query_keys(qkv, heads, kv_heads, q_norm, k_norm, cos, signed_sin)  # [n, H + H_kv, D]
            keys, values = cache.update(qk[:, heads:, None], qkv[:, heads + kv_heads :, None], index)
            out = decode_attention(qk[:, :heads, None], keys, values, mask, scaling)  # [n, H, 1, D] fp32, as sdpa_gqa
            x = x + packed_product(out.reshape(rows, heads * dim), o_weight)
            gate_up = packed_product(norm_mid(x), gate_up_weight)
            inner = gate_up.shape[-1] // 2
            x = x + packed_product(F.silu(gate_up[:, :inner]) * gate_up[:, inner:], down_weight)
            if index == self.captured and states is not None:
                states.append(x[:, None])
        return packed_product(self.final_norm(x), self.head)


def _has_foreign_hooks(model: torch.nn.Module) -> bool:
    """Whether a forward hook other than the boundary capture's would miss the step's calls."""
    module_hooks = torch.nn.modules.module
    if any(getattr(module_hooks, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")):
        return True
    known = {CAPTURED_BLOCK.get(model, (None, None))[1]}
    return any(set(m._forward_hooks) - known or m._forward_pre_hooks for m in model.modules())


def decoder_linears(model: Any) -> list[torch.nn.Linear] | None:
    """The output layer and every block's projections (q, k, v, o, gate, up, down) of a decoder whose
    written-out step this module and :mod:`~spader_pipeline.modeling.graph_decode` compute: a family of
    :data:`SUPPORTED_MODEL_TYPES` with SiLU, full attention in every block and ``nn.Linear`` projections;
    ``None`` for any other model."""
    config, body = getattr(model, "config", None), getattr(model, "model", None)
    if not isinstance(model, torch.nn.Module) or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    if getattr(config, "hidden_act", None) != "silu":
        return None
    if not all(hasattr(body, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return None
    head = getattr(model, "lm_head", None)
    linears = [head] + [getattr(part, name, None) for block in body.layers
                        for part, names in ((block.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                            (block.mlp, ("gate_proj", "up_proj", "down_proj")))
                        for name in names]
    return linears if all(isinstance(m, torch.nn.Linear) for m in linears) else None


def _structure_supported(model: Any) -> bool:
    linears = decoder_linears(model)
    if linears is None or getattr(model.config, "_attn_implementation", None) != GQA_ATTENTION:
        return False
    return all(m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in linears)


def fused_decode_step_applies(model: Any) -> bool:
    """Whether a decoding step of ``model`` called now runs as :class:`FusedDecodeStep` (its result the
    model's own): a supported family (:data:`SUPPORTED_MODEL_TYPES`, full attention, SiLU) on the CPU in
    fp32 with the ``sdpa_gqa`` attention, called without gradients under bf16 autocast with packed weights
    (:func:`~spader_pipeline.modeling.packed_linear.packing_available`), and no forward hook but the
    boundary capture's."""
    if not (FUSED_DECODE_STEP and packed_linear.PACK_WEIGHTS) or torch.is_grad_enabled():
        return False
    if not torch.is_autocast_enabled("cpu") or torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return False
    return _structure_supported(model) and not _has_foreign_hooks(model) and packing_available()


def fused_decode_step(model: Any) -> FusedDecodeStep | None:
    """:class:`FusedDecodeStep` for ``model`` where :func:`fused_decode_step_applies`, else ``None``. Call it
    once per decoding call (it re-packs weights that changed)."""
    return FusedDecodeStep(model) if fused_decode_step_applies(model) else None


def decoding_path(device: str = "auto", bf16: bool | str = "auto", *, bf16_weights: bool = False) -> dict[str, str]:
    """How this machine decodes a grouped-query model of a supported family (:data:`SUPPORTED_MODEL_TYPES`:
    SmolLM2, the tests' Qwen3) on ``device``
    with ``bf16`` autocast (both as the trainer's settings take them: ``auto`` resolved here) from fp32
    weights, or (``bf16_weights``) from a bf16 copy of them without autocast (``rollout_weights: bf16``):

    * ``decode.step``: ``cpp`` (the C++ step, :mod:`~spader_pipeline.modeling.native_step`), ``python``
      (:class:`FusedDecodeStep`), ``transformers`` (the model's own forward), or where the static step is
      selected (:mod:`~spader_pipeline.modeling.graph_decode`; by default on CUDA) ``graph`` (captured in
      CUDA graphs) or ``static`` (launched op by op);
    * ``decode.attention``: ``cpp`` (the native attention over the bf16 cache), ``sdpa`` (SDPA; on the
      CPU in fp32 over the widened cache) or, the static step's on CUDA under ``SPADER_DECODE_ATTENTION``,
      ``triton`` (:mod:`~spader_pipeline.modeling.triton_attention`; ``triton 64/8/3`` where
      ``SPADER_TRITON_LAUNCH`` sets another launch);
    * ``decode.kv_cache``: the keys' precision in the cache, ``bf16`` (stored in bf16 for the native
      attention, held in fp32 for SDPA) or ``fp32``;
    * ``decode.packed_weights``: ``on`` where the products read weights packed for oneDNN once
      (:mod:`~spader_pipeline.modeling.packed_linear`), else ``off``;
    * ``decode.kernels``: the work between a step's products: ``triton`` (the static step's fused kernels under
      ``SPADER_DECODE_KERNELS``, :mod:`~spader_pipeline.modeling.triton_step`), ``cpp`` (the C++ step) or
      ``aten`` (torch's operations).

    The Triton attention and kernels take heads of a power of two, as the supported families' are (SmolLM2's
    64, Qwen3's 128); this reads settings, not a model, so for another model it names them where the step
    would use torch's (the step's own choice: ``graph_decode._Decoder.runner``).

    The C++ and Python steps and attentions compute the same sums, in another order where the attention
    is SDPA's (log-probabilities within ``tests/modeling/test_modeling_decoding_path.py``'s bound); the key
    cache's dtype moves them within the bound ``tests/modeling/test_modeling_decode_attention.py`` states.
    It reads the module switches (:data:`FUSED_DECODE_STEP`, ``PACK_WEIGHTS``, ``BF16_CACHE``,
    ``NATIVE_STEP``) and, on a CPU under autocast, builds or loads the C++ step once per process.
    """
    device = resolve_device(device)
    static = static_step_name(device)  # the static step (graph_decode) where it is selected for this device
    cpu = torch.device(device).type == "cpu"
    autocast = resolve_bf16(bf16, device)
    # the static step on CUDA (on a CPU: a model in its own dtype) attends with SDPA or the Triton kernel
    attention = static_attention_name() if static and (not cpu or bf16_weights or not autocast) else "sdpa"
    if attention == "triton":  # with its launch where not the default
        attention = triton_attention.launch_name()
    # the fused Triton kernels between the static step's products take an fp32 residual stream whose attention is
    # SDPA's kind: CUDA under autocast, or fp32 weights
    kernels = static_kernels_name() if static and not bf16_weights and (not cpu or not autocast) else "aten"
    if bf16_weights:  # bf16 keys and values from bf16 projections, SDPA in bf16: the model's forward
        return {"decode.step": static or "transformers", "decode.attention": attention, "decode.kv_cache": "bf16",
                "decode.packed_weights": "off", "decode.kernels": kernels}
    packed = cpu and autocast and packed_linear.PACK_WEIGHTS and packing_available()
    fused = packed and FUSED_DECODE_STEP
    native = cpu and autocast and native_available()
    bf16_keys = autocast and (not cpu or attention_settings.bf16_key_cache())
    step = static or ("cpp" if fused and native and native_step.NATIVE_STEP else "python" if fused else "transformers")
    return {
        "decode.step": step,
        "decode.attention": "cpp" if native and bf16_keys else attention,
        "decode.kv_cache": "bf16" if bf16_keys else "fp32",
        "decode.packed_weights": "on" if packed else "off",
        "decode.kernels": "cpp" if step == "cpp" else kernels,
    }
