"""The Triton kernel of :mod:`~spader_pipeline.modeling.triton_attention` (imported only where Triton is
installed: it imports Triton, and ``TRITON_INTERPRET=1`` must be set before that for the interpreter)."""

import triton
import triton.language as tl


@triton.jit
def attend_block(q, key_base, value_base, valid_base, start, stop, key_position, value_position, scale, best,
                 total, acc, DIM: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """One block of ``BLOCK`` positions from ``start`` into the online softmax (``best``, ``total``, ``acc``);
    positions at or past ``stop`` are neither loaded nor attended."""
    dims = tl.arange(0, DIM)
    positions = start + tl.arange(0, BLOCK)
    inside = positions < stop
    held = tl.load(valid_base + positions, mask=inside, other=0) != 0
    k = tl.load(key_base + positions[:, None] * key_position + dims[None, :], mask=inside[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK], fp32
    scores = tl.where(held[None, :], scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    # a group row with nothing held yet keeps -inf: exp(-inf - -inf) is nan, so shift by 0 there
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)
    rescale = tl.exp(best - shift)
    probs = tl.exp(scores - shift[:, None])
    total = total * rescale + tl.sum(probs, 1)
    v = tl.load(value_base + positions[:, None] * value_position + dims[None, :], mask=inside[:, None], other=0.0)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    return new_best, total, acc


@triton.jit
def decode_attention_kernel(query, keys, values, valid, end, first, out, scale,
                            query_row, query_head, query_group, key_row, key_head, key_position,
                            value_row, value_head, value_position, valid_row, out_row, out_head, out_group,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                            LENGTH: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
                            HAS_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM)
    q = tl.load(query + row * query_row + head * query_head + groups[:, None] * query_group + dims[None, :],
                mask=groups[:, None] < GROUP, other=0.0)
    stop = tl.load(end)
    begin = 0
    if HAS_FIRST:  # the row's first held position: the blocks wholly before it (its left padding) are not read
        begin = tl.load(first + row) // BLOCK * BLOCK
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
    key_base = keys + row * key_row + head * key_head
    value_base = values + row * value_row + head * value_head
    valid_base = valid + row * valid_row
    if LENGTH > 0:  # a range over the view's length (a constant: a kernel per length), blocks past stop masked
        for start in range(0, LENGTH, BLOCK):
            best, total, acc = attend_block(q, key_base, value_base, valid_base, start, stop, key_position,
                                            value_position, scale, best, total, acc, DIM, BLOCK,
                                            PRECISION)
    elif INTERPRETED:  # Triton's interpreter: a range over a loaded bound fails there, a while runs
        start = begin
        while start < stop:
            best, total, acc = attend_block(q, key_base, value_base, valid_base, start, stop, key_position,
                                            value_position, scale, best, total, acc, DIM, BLOCK,
                                            PRECISION)
            start += BLOCK
    else:  # up to stop, no block past it: a range the compiler pipelines (a while it does not)
        for start in range(begin, stop, BLOCK):
            best, total, acc = attend_block(q, key_base, value_base, valid_base, start, stop, key_position,
                                            value_position, scale, best, total, acc, DIM, BLOCK,
                                            PRECISION)
    result = acc / total[:, None]
    tl.store(out + row * out_row + head * out_head + groups[:, None] * out_group + dims[None, :],
             result.to(out.dtype.element_ty), mask=groups[:, None] < GROUP)
