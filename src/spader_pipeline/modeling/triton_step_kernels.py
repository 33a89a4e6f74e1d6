"""The Triton kernels of :mod:`~spader_pipeline.modeling.triton_step` (imported only where Triton is installed:
it imports Triton, and ``TRITON_INTERPRET=1`` must be set before that for the interpreter).

Each computes what the static step's torch operations compute, in the same order of fp32 operations (the
launches turn off the fusion of a product and a sum into one rounding; the temperature's division is the
correctly rounded one, ``div_rn``), so that only the sums over a row (a norm's mean, the sampling's totals),
Triton's ``rsqrt``, ``exp`` and its other divisions (within 2 ulp, not correctly rounded) may round otherwise."""

import triton
import triton.language as tl


@triton.jit
def _norm_into(r, weight, normed, columns, inside, eps, WIDTH: tl.constexpr):
    """``weight * (r * rsqrt(mean(r²) + eps))`` of one row ``r`` (fp32) stored at ``normed`` in its dtype."""
    mean = tl.sum(r * r, 0) / WIDTH
    w = tl.load(weight + columns, mask=inside, other=0.0).to(tl.float32)
    tl.store(normed + columns, (w * (r * tl.rsqrt(mean + eps))).to(normed.dtype.element_ty), mask=inside)


@triton.jit
def residual_norm_kernel(residual, delta, weight, normed, eps, residual_row, delta_row, normed_row,
                         WIDTH: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    """One row: ``residual += delta`` (written back), then ``weight * (r * rsqrt(mean(r²) + eps))`` cast to
    ``normed``'s dtype."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < WIDTH
    r = tl.load(residual + row * residual_row + columns, mask=inside, other=0.0).to(tl.float32)
    if HAS_DELTA:
        r = r + tl.load(delta + row * delta_row + columns, mask=inside, other=0.0).to(tl.float32)
        tl.store(residual + row * residual_row + columns, r.to(residual.dtype.element_ty), mask=inside)
    _norm_into(r, weight, normed + row * normed_row, columns, inside, eps, WIDTH)


@triton.jit
def embed_norm_kernel(token, embed, weight, residual, normed, valid, cursor, eps, embed_row, residual_row,
                      normed_row, valid_row, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """One row's start of a step: its token's embedding into ``residual`` (its dtype), its position at the cursor
    marked attendable in ``valid``, and the first norm of the embedding (as :func:`residual_norm_kernel`'s)."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < WIDTH
    r = tl.load(embed + tl.load(token + row) * embed_row + columns, mask=inside, other=0.0)
    tl.store(residual + row * residual_row + columns, r.to(residual.dtype.element_ty), mask=inside)
    tl.store(valid + row * valid_row + tl.load(cursor), tl.full([], 1, tl.uint8))
    _norm_into(r.to(residual.dtype.element_ty).to(tl.float32), weight, normed + row * normed_row, columns, inside,
               eps, WIDTH)


@triton.jit
def _head_norm(x, partner_x, weight, dims, partners, eps, IN_DTYPE: tl.constexpr, DIM: tl.constexpr):
    """``x`` ``[heads, DIM]`` fp32 (and its rotation partners, the same heads' other halves) normed per head as the
    model's RMSNorm writes it: fp32 statistics, the normed values in the input's dtype, times the fp32 weight."""
    scale = tl.rsqrt(tl.sum(x * x, 1) / DIM + eps)[:, None]
    w = tl.load(weight + dims).to(tl.float32)[None, :]
    w_partner = tl.load(weight + partners).to(tl.float32)[None, :]
    return (w * (x * scale).to(IN_DTYPE).to(tl.float32),
            w_partner * (partner_x * scale).to(IN_DTYPE).to(tl.float32))


@triton.jit
def rotary_cache_kernel(qkv, cos, sin, position, q_weight, k_weight, query, keys, values, cursor, q_eps, k_eps,
                        qkv_row, qkv_head, cos_row, sin_row, query_row, query_head, key_row, key_head, key_position,
                        value_row, value_head, value_position,
                        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                        DIM: tl.constexpr, HEAD_NORMS: tl.constexpr):
    """One row of a step's q|k|v product ``[H + 2 H_kv, D]``: the query heads (normed per head where the family
    does) rotated by the rotary tables' row at the row's ``position`` into ``query``; the key heads so, and the
    value heads as they are, written into the caches at the position ``cursor`` holds."""
    row = tl.program_id(0).to(tl.int64)
    at = tl.load(cursor).to(tl.int64)
    logical = tl.load(position + row).to(tl.int64)
    dims = tl.arange(0, DIM)
    partners = (dims + DIM // 2) % DIM  # rotate_half: the other half of the same head
    c = tl.load(cos + logical * cos_row + dims)[None, :]
    s = tl.load(sin + logical * sin_row + dims)
    signed = tl.where(dims < DIM // 2, -s, s)[None, :]  # rotate_half's sign, on sin (negation is exact)
    base = qkv + row * qkv_row
    in_dtype = qkv.dtype.element_ty

    heads = tl.arange(0, HEADS_PAD)[:, None]
    held = heads < HEADS
    q = tl.load(base + heads * qkv_head + dims[None, :], mask=held, other=0.0).to(tl.float32)
    q_partner = tl.load(base + heads * qkv_head + partners[None, :], mask=held, other=0.0).to(tl.float32)
    if HEAD_NORMS:
        q, q_partner = _head_norm(q, q_partner, q_weight, dims, partners, q_eps, in_dtype, DIM)
    q = q * c + q_partner * signed
    tl.store(query + row * query_row + heads * query_head + dims[None, :], q.to(query.dtype.element_ty), mask=held)

    kv_heads = tl.arange(0, KV_PAD)[:, None]
    kv_held = kv_heads < KV_HEADS
    k_base = base + HEADS * qkv_head
    k = tl.load(k_base + kv_heads * qkv_head + dims[None, :], mask=kv_held, other=0.0).to(tl.float32)
    k_partner = tl.load(k_base + kv_heads * qkv_head + partners[None, :], mask=kv_held, other=0.0).to(tl.float32)
    if HEAD_NORMS:
        k, k_partner = _head_norm(k, k_partner, k_weight, dims, partners, k_eps, in_dtype, DIM)
    k = k * c + k_partner * signed
    tl.store(keys + row * key_row + kv_heads * key_head + at * key_position + dims[None, :],
             k.to(keys.dtype.element_ty), mask=kv_held)
    v = tl.load(k_base + (KV_HEADS + kv_heads) * qkv_head + dims[None, :], mask=kv_held, other=0.0)
    tl.store(values + row * value_row + kv_heads * value_head + at * value_position + dims[None, :],
             v.to(values.dtype.element_ty), mask=kv_held)


@triton.jit
def silu_mul_kernel(gate_up, out, gate_up_row, out_row, INNER: tl.constexpr, BLOCK: tl.constexpr):
    """A block of one row: ``silu(gate)`` in the gate's dtype, times ``up``, in ``out``'s dtype (``gate_up`` is
    ``[gate | up]``, ``INNER`` each)."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < INNER
    base = gate_up + row * gate_up_row
    gate = tl.load(base + columns, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(base + INNER + columns, mask=inside, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(gate_up.dtype.element_ty).to(tl.float32)
    tl.store(out + row * out_row + columns, (activated * up).to(out.dtype.element_ty), mask=inside)


@triton.jit
def sample_kernel(logits, uniforms, step, eos, budget, done, count, token, tokens, log_probs, temperature,
                  logits_row, uniforms_step, tokens_row, log_probs_row,
                  VOCAB: tl.constexpr, BLOCK: tl.constexpr, DO_SAMPLE: tl.constexpr, LOG_PROBS: tl.constexpr,
                  EOS_COUNT: tl.constexpr, EOS_PAD: tl.constexpr):
    """One row's token at ``step`` from its logits over ``temperature``: the greedy maximum (the first), or the
    inverse-CDF draw of the row's uniform number at ``step`` (the first token whose running sum of
    ``exp(s - max)`` exceeds the number times their total; past it, the last token of positive weight), its
    log-probability ``s - logsumexp(s)``, and the row's bookkeeping as the static step's sampling keeps it:
    the token recorded at ``step`` and fed next, counted while the row had not ended, the row ended by an
    end token or its budget."""
    row = tl.program_id(0).to(tl.int64)
    at = tl.load(step)
    base = logits + row * logits_row
    # the maximum, and the greedy token: the first of the largest
    best = tl.full([], float("-inf"), tl.float32)
    chosen = tl.zeros([], tl.int64)
    for start in range(0, VOCAB, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        s = tl.div_rn(tl.load(base + columns, mask=columns < VOCAB, other=float("-inf")).to(tl.float32), temperature)
        block_best = tl.max(s, 0)
        if not DO_SAMPLE:
            first = tl.min(tl.where(s == block_best, columns, VOCAB), 0).to(tl.int64)
            chosen = tl.where(block_best > best, first, chosen)
        best = tl.maximum(best, block_best)
    # the total of exp(s - max), block by block: the draw's running sums below add the same block sums
    total = tl.zeros([], tl.float32)
    for start in range(0, VOCAB, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        s = tl.div_rn(tl.load(base + columns, mask=columns < VOCAB, other=float("-inf")).to(tl.float32), temperature)
        total += tl.sum(tl.exp(s - best), 0)
    if DO_SAMPLE:
        draw = tl.load(uniforms + at * uniforms_step + row) * total
        running = tl.zeros([], tl.float32)
        chosen = tl.full([], VOCAB, tl.int64)
        last = tl.zeros([], tl.int64)
        for start in range(0, VOCAB, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            s = tl.div_rn(tl.load(base + columns, mask=columns < VOCAB, other=float("-inf")).to(tl.float32), temperature)
            weight = tl.exp(s - best)
            # a token of weight 0 is never drawn: the first whose running sum exceeds the draw where it grew
            passed = ((tl.cumsum(weight, 0) + running) > draw) & (weight > 0)
            chosen = tl.minimum(chosen, tl.min(tl.where(passed, columns, VOCAB), 0).to(tl.int64))
            last = tl.maximum(last, tl.max(tl.where(weight > 0, columns, 0), 0).to(tl.int64))
            running += tl.sum(weight, 0)
        chosen = tl.where(chosen >= VOCAB, last, chosen)  # the draw rounded up to the total
    if LOG_PROBS:
        picked = tl.div_rn(tl.load(base + chosen).to(tl.float32), temperature)
        tl.store(log_probs + row * log_probs_row + at, picked - (best + tl.log(total)))
    tl.store(tokens + row * tokens_row + at, chosen)
    was_done = tl.load(done + row)
    tl.store(count + row, tl.load(count + row) + (1 - was_done).to(tl.int64))
    ends = tl.load(eos + tl.arange(0, EOS_PAD), mask=tl.arange(0, EOS_PAD) < EOS_COUNT, other=-1)
    ended = (tl.sum((ends == chosen).to(tl.int32), 0) > 0) | (at + 1 >= tl.load(budget + row))
    tl.store(done + row, was_done | ended.to(tl.uint8))
    tl.store(token + row, chosen)


@triton.jit
def advance_kernel(position, cursor, step, rows, BLOCK: tl.constexpr):
    """The end of a step: a block of the first ``rows`` rows' logical positions up by one, and (the first program)
    the cursor and the sampling's step."""
    block = tl.program_id(0)
    at = block * BLOCK + tl.arange(0, BLOCK)
    inside = at < rows
    tl.store(position + at, tl.load(position + at, mask=inside) + 1, mask=inside)
    if block == 0:
        tl.store(cursor, tl.load(cursor) + 1)
        tl.store(step, tl.load(step) + 1)
