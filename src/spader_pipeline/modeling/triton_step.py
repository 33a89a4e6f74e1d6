"""The static decoding step's work between its products as three Triton kernels (four launches a block where
torch's operations take fifteen), its start, its sampling and its end as one kernel each.

Captured in a CUDA graph, a decoding step of SmolLM2 was ~640 kernels (30 blocks of 20, and 40 around them:
the embedding, the rotary tables, the mask, the head, the sampling, the advance), and on an H200 a graph's
kernel costs ~3 µs however little it does: a step at 1 row took 1.9 ms where its arithmetic takes ~0.1
(docs/results.md, "One GPU"). Between a block's four products, torch runs the residual's add, the norm and
the cast to bf16 (3 kernels, twice), the rotary embedding (4), the cast of the query, the keys' and values'
writes into the cache and the query's copy into the attention's layout (4), SwiGLU's activation and product
(2). vLLM and SGLang fuse the same groups (``fused_add_rms_norm``, ``rotary_embedding`` with
``reshape_and_cache``, ``silu_and_mul``); here, with the static step's layout:

* :func:`residual_norm`: the residual stream plus a product's output, written back in place, and the
  block's norm of it in the products' dtype (one program a row);
* :func:`rotary_cache`: one row's q|k|v product: the query and key heads normed per head where the family
  does (Qwen3), rotated by the rotary tables' row at the row's position (made once per static cache,
  :meth:`~spader_pipeline.modeling.graph_decode._Step.rotary_tables`), the query written in the attention's
  layout and dtype, the keys and the values into the static cache at the cursor (read from the device, so a
  captured graph stays valid as it moves);
* :func:`silu_mul`: ``silu(gate) * up``;
* :func:`embed_norm`: the step's start: the tokens' embeddings (the residual stream), their position marked
  attendable, the first block's norm;
* :func:`sample_step`: the step's sampling (~30 kernels and some 2 GB of fp32 passes over the vocabulary at
  768 rows: the cast, the temperature, the softmax, its running sum, the draw, the log-softmax, the rows'
  bookkeeping) as one program a row reading the bf16 logits three times, where the call's processors are a
  temperature alone (top-k, top-p and min-p sort the scores: those stay torch's);
* :func:`advance`: the step's end: positions, cursor and sampling step moved on.

A block is then 9 launches (its four products, the attention, four kernels) and the step around the blocks
5 (the start, the mask, the head, the sampling, the advance): 275 a step.

Numerics: the same fp32 operations in the same order as the torch code they replace (the launches turn off
the fusion of a product and a sum into one rounding), except a norm's sum of squares, which a kernel adds in
its own order (as torch's own CUDA ``rms_norm`` does), Triton's ``rsqrt``, ``exp`` and divisions (within 2 ulp;
the temperature's is correctly rounded), and the sampling's sums (its total and running sums over the
vocabulary in blocks, where torch's softmax normalises first: a draw within a few ulps of a token's boundary
may fall on its neighbour). The rotation is the same bits. The static step with them gives the step without
them within bf16's rounding (the gpu-marked tests, with the bound they hold the Triton attention to); graphs
and the same step op by op give the same floats.

Selected with ``SPADER_DECODE_KERNELS=triton`` (:data:`~spader_pipeline.modeling.static_cache.DECODE_KERNELS`)
where Triton runs (:func:`~spader_pipeline.modeling.triton_attention.available`) and the step's residual
stream is fp32 (bf16 autocast over fp32 weights, as the trainer decodes, or fp32); the CPU tests run them
through Triton's interpreter in fp32 and fp16 (its bf16 casts truncate).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["advance", "embed_norm", "residual_norm", "rotary_cache", "sample_step", "silu_mul"]

#: SwiGLU's columns a program computes
SILU_BLOCK = 1024


@functools.cache
def _kernels():
    from spader_pipeline.modeling import triton_step_kernels

    return triton_step_kernels


def _pow2(n: int) -> int:
    """The smallest power of two that is at least ``n`` (a Triton block's size)."""
    return 1 << max(n - 1, 0).bit_length()


def residual_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """``residual += delta`` in place (``None``: no add), then RMSNorm of it with ``weight`` and ``eps`` (fp32
    statistics, ``weight * normed``) in ``dtype``. ``residual`` ``[n, W]`` (fp32), ``delta`` ``[n, W]`` (any
    float dtype), ``weight`` ``[W]``; rows contiguous. Returns ``[n, W]`` in ``dtype``."""
    rows, width = residual.shape
    normed = torch.empty((rows, width), dtype=dtype, device=residual.device)
    block = _pow2(width)
    _kernels().residual_norm_kernel[(rows,)](
        residual, delta if delta is not None else residual, weight, normed, eps, residual.stride(0),
        delta.stride(0) if delta is not None else 0, normed.stride(0), WIDTH=width, BLOCK=block,
        HAS_DELTA=delta is not None, num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)
    return normed


def embed_norm(token: torch.Tensor, embed: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
               valid: torch.Tensor, cursor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's start: ``token`` long ``[n]`` embedded by ``embed`` ``[V, W]`` (the residual stream, in
    ``embed``'s dtype, as ``F.embedding``), each row's position ``cursor`` (long ``[1]`` on the device) marked
    attendable in ``valid`` bool ``[R, L]`` (``R >= n``), and the first block's norm of the embedding
    (:func:`residual_norm`'s, ``weight``, ``eps``) in ``dtype``. Returns the residual and the normed ``[n, W]``."""
    rows, (_, width) = token.shape[0], embed.shape
    residual = torch.empty((rows, width), dtype=embed.dtype, device=embed.device)
    normed = torch.empty((rows, width), dtype=dtype, device=embed.device)
    block = _pow2(width)
    _kernels().embed_norm_kernel[(rows,)](
        token, embed, weight, residual, normed, valid.view(torch.uint8), cursor, eps, embed.stride(0),
        residual.stride(0), normed.stride(0), valid.stride(0), WIDTH=width, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False)
    return residual, normed


def rotary_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor,
                 q_norm: torch.nn.Module | None, k_norm: torch.nn.Module | None, keys: torch.Tensor,
                 values: torch.Tensor, cursor: torch.Tensor, query_dtype: torch.dtype, heads: int) -> torch.Tensor:
    """A step's q|k|v product ``qkv`` ``[n, H + 2 H_kv, D]`` (``heads`` = H): query and key heads normed per
    head by ``q_norm``/``k_norm`` (``None``: not), rotated by the rows of the rotary tables ``cos``/``sin``
    ``[L, D]`` fp32 (transformers' values at positions 0..L-1, ``rotate_half``'s convention) at each row's
    ``position`` (long ``[n]``); the keys and the values written into ``keys``/``values`` ``[n, H_kv, L', D]``
    (views of the static cache) at position ``cursor`` (long ``[1]`` on the device). Returns the rotated query
    ``[n, H, D]`` in ``query_dtype``."""
    rows, width, dim = qkv.shape
    kv_heads = (width - heads) // 2
    if qkv.stride(2) != 1 or keys.stride(3) != 1 or values.stride(3) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary_cache: the head dimension must be contiguous")
    query = torch.empty((rows, heads, dim), dtype=query_dtype, device=qkv.device)
    norms = q_norm is not None
    _kernels().rotary_cache_kernel[(rows,)](
        qkv, cos, sin, position, q_norm.weight if norms else cos, k_norm.weight if norms else cos, query, keys, values,
        cursor, q_norm.variance_epsilon if norms else 0.0, k_norm.variance_epsilon if norms else 0.0, qkv.stride(0),
        qkv.stride(1), cos.stride(0), sin.stride(0), query.stride(0), query.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), values.stride(0), values.stride(1), values.stride(2), HEADS=heads, KV_HEADS=kv_heads,
        HEADS_PAD=_pow2(heads), KV_PAD=_pow2(kv_heads), DIM=dim, HEAD_NORMS=norms, num_warps=4,
        enable_fp_fusion=False)
    return query


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up`` ``[n, 2 I]`` (``[gate | up]``), in its dtype: ``[n, I]``."""
    rows, width = gate_up.shape
    inner = width // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, _pow2(inner))
    _kernels().silu_mul_kernel[(rows, -(-inner // block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INNER=inner, BLOCK=block, num_warps=4,
        enable_fp_fusion=False)
    return out


#: vocabulary entries a sampling program reads at a time: one program a row walks the vocabulary three times
#: (SmolLM2's 49,152 in 12 blocks a walk), so at a few rows the step waits on one program's walk
SAMPLE_BLOCK = 4096


def sample_step(logits: torch.Tensor, *, temperature: float, do_sample: bool, step: torch.Tensor,
                uniforms: torch.Tensor, eos: torch.Tensor, budget: torch.Tensor, done: torch.Tensor,
                count: torch.Tensor, token: torch.Tensor, tokens: torch.Tensor,
                log_probs: torch.Tensor | None) -> None:
    """The static step's sampling of each row of ``logits`` ``[n, V]`` as one kernel (the torch operations it
    replaces: the cast to fp32, the temperature, the softmax, its running sum, the draw, the log-softmax, the
    row's bookkeeping; some 30 kernels and ~2 GB of passes over the vocabulary at 768 rows): greedy (the first
    largest ``logits / temperature``) or drawn by inverse CDF with row ``r``'s ``uniforms[step, r]``; its
    log-probability under ``logits / temperature`` into ``log_probs[r, step]`` (``None``: not kept); the token
    into ``tokens[r, step]`` and ``token[r]``; ``count[r]`` up by one while the row had not ended; ``done[r]``
    set by an end token (``eos``, long) or the row's ``budget``. ``step``: long ``[1]`` on the device (read, not
    advanced). Row buffers are the static cache's (``[R]``, ``[R, S]``, ``uniforms`` ``[S, R]``), ``R >= n``."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("sample_step: the vocabulary must be contiguous")
    keep = log_probs is not None
    _kernels().sample_kernel[(rows,)](
        logits, uniforms, step, eos if eos.numel() else step, budget, done.view(torch.uint8), count, token, tokens,
        log_probs if keep else uniforms, float(temperature), logits.stride(0), uniforms.stride(0), tokens.stride(0),
        log_probs.stride(0) if keep else 0, VOCAB=vocab, BLOCK=min(SAMPLE_BLOCK, _pow2(vocab)), DO_SAMPLE=do_sample,
        LOG_PROBS=keep, EOS_COUNT=eos.numel(), EOS_PAD=_pow2(max(eos.numel(), 1)), num_warps=8,
        enable_fp_fusion=False)


#: rows a program of the step's advance moves on (one program up to the largest row bucket)
ADVANCE_BLOCK = 1024


def advance(position: torch.Tensor, rows: int, cursor: torch.Tensor, step: torch.Tensor) -> None:
    """A step's end as one launch: ``position[:rows] += 1``, ``cursor += 1``, ``step += 1`` (long, on the device)."""
    _kernels().advance_kernel[(-(-rows // ADVANCE_BLOCK),)](position, cursor, step, rows, BLOCK=ADVANCE_BLOCK,
                                                            num_warps=4)
