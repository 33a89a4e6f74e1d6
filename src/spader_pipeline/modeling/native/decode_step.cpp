// One decoding step of a Llama-family decoder on the CPU, in C++: the operator calls of
// spader_pipeline/modeling/decode_step.py's FusedDecodeStep without Python between them, and the
// decoding attention over a bf16 cache as two loops around ATen's softmax.
//
// Built once per machine by spader_pipeline/modeling/native_step.py (torch.utils.cpp_extension, -O3
// -march=native) and registered as the operators spader_native::decode_attention and
// spader_native::decode_step. The step calls the same ATen operators as the Python step, on the same
// tensors, in the same order (the packed oneDNN products, rms_norm or the norm's written-out formula,
// the rotary embedding, SiLU), so its logits are the Python step's bit for bit; the attention is the
// one both run (tests/modeling/test_modeling_decode_step.py, test_modeling_native_step.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// bf16 -> fp32 is exact: the bf16 bits are the upper half of the float's.
inline float widen(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// `row` (dim bf16 values) widened into `out`.
inline void widen_row(const uint16_t* row, float* out, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = widen(row[d]);
}

// How many positions ahead of the one it reads an attention loop asks for the cache's rows. A decoding
// step reads every layer's keys and values once (hundreds of MB at 32 rows of ~800 positions), far more
// than the CPU's caches hold; with the next rows requested early the loop does not wait on memory for
// each one (docs/results.md, "Measurements behind the defaults"). It changes which rows are in the
// cache, never a value.
constexpr int64_t kPrefetchPositions = 16;

// Ask for the row kPrefetchPositions after `position` of `rows` (`length` rows of `dim` bf16 values,
// `stride` apart), each 64-byte line of it, to be brought into the cache; nothing past the last row.
inline void prefetch_ahead(const uint16_t* rows, int64_t stride, int64_t position, int64_t length, int64_t dim) {
  if (position + kPrefetchPositions >= length) return;
  const char* bytes = reinterpret_cast<const char*>(rows + (position + kPrefetchPositions) * stride);
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(uint16_t)); offset += 64)
    __builtin_prefetch(bytes + offset, 0, 3);
}

// sum_d a[d] * b[d] in fp32 over 16 running sums (one vector register's lanes), then added pairwise.
inline float dot(const float* a, const float* b, int64_t dim) {
  float lanes[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[d + j] * b[d + j];
  for (int width = 8; width > 0; width /= 2)  // a tree over the lanes: vector adds, not 16 dependent ones
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  float sum = lanes[0];
  for (; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

// The scores of one key/value head's `group` query heads (q: [group, dim] fp32, scaled) over its `length`
// cached keys (bf16, `key_stride` apart), -inf where `mask` (or none) is false: out [group, width]
// (its first `length` columns; width >= length).
void group_scores(const float* q, const uint16_t* keys, int64_t key_stride, const bool* mask, float* out,
                  int64_t group, int64_t length, int64_t width, int64_t dim, float* wide) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  if (dim % 16 == 0 && dim <= 256) {  // each key row widened into registers once, for every query head
    const int64_t chunks = dim / 16;
    __m512 key[16];
    for (int64_t position = 0; position < length; ++position) {
      if (mask != nullptr && !mask[position]) {
        for (int64_t g = 0; g < group; ++g) out[g * width + position] = minus_inf;
        continue;
      }
      const uint16_t* row = keys + position * key_stride;
      prefetch_ahead(keys, key_stride, position, length, dim);
      for (int64_t c = 0; c < chunks; ++c)
        key[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c))), 16));
      for (int64_t g = 0; g < group; ++g) {
        const float* query = q + g * dim;
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(query), key[0]);
        for (int64_t c = 1; c < chunks; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(query + 16 * c), key[c], sum);
        out[g * width + position] = _mm512_reduce_add_ps(sum);
      }
    }
    return;
  }
#endif
  for (int64_t position = 0; position < length; ++position) {
    if (mask != nullptr && !mask[position]) {
      for (int64_t g = 0; g < group; ++g) out[g * width + position] = minus_inf;
      continue;
    }
    prefetch_ahead(keys, key_stride, position, length, dim);
    widen_row(keys + position * key_stride, wide, dim);
    for (int64_t g = 0; g < group; ++g) out[g * width + position] = dot(q + g * dim, wide, dim);
  }
}

// out [group, dim] fp32 (zeros on entry) = the attention weights p [group, width] (its first `length`
// columns) times the `length` cached values (bf16, `value_stride` apart); masked positions (weight 0) are
// skipped.
void group_values(const float* p, const uint16_t* values, int64_t value_stride, const bool* mask, float* out,
                  int64_t group, int64_t length, int64_t width, int64_t dim, float* wide) {
#if defined(__AVX512F__)
  if (dim % 16 == 0 && dim <= 256 && group <= 16) {  // the group's sums stay in registers over all positions
    const int64_t chunks = dim / 16;
    __m512 sums[16][16];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < chunks; ++c) sums[g][c] = _mm512_setzero_ps();
    for (int64_t position = 0; position < length; ++position) {
      if (mask != nullptr && !mask[position]) continue;
      const uint16_t* row = values + position * value_stride;
      prefetch_ahead(values, value_stride, position, length, dim);
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c))), 16));
        for (int64_t g = 0; g < group; ++g)
          sums[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * width + position]), value, sums[g][c]);
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + g * dim + 16 * c, sums[g][c]);
    return;
  }
#endif
  for (int64_t position = 0; position < length; ++position) {
    if (mask != nullptr && !mask[position]) continue;
    prefetch_ahead(values, value_stride, position, length, dim);
    widen_row(values + position * value_stride, wide, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float w = p[g * width + position];
      float* o = out + g * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += w * wide[d];
    }
  }
}

// Attention of one query position per row over a bf16 cache, in fp32.
// query fp32 [n, H, D] (any strides), keys/values bf16 [n, H_kv, L, D] (the last dimension
// contiguous: views of the cache's buffers), mask bool [n, L] (true: attend) or none -> fp32 [n, H, D].
// Each (row, key/value head) reads its keys and values once for its H / H_kv query heads: the scores
// q.k over D, ATen's softmax over L, then the values weighted by it.
//
// The result does not depend on how many masked positions follow the last attended one (the host loop
// attends over its cache's exact length, the static step over a length bucket): scores and values are
// per position, and ATen's softmax over a row of at least one vector register's width spreads the row
// over the register's lanes from its first position, so -inf scores past the end add exp(-inf) = 0 to
// lanes and change no sum. A shorter row takes another order (a scalar tail), so rows shorter than
// kSoftmaxMinWidth are padded with -inf to it.
constexpr int64_t kSoftmaxMinWidth = 64;  // >= any CPU's fp32 vector: 8 lanes (AVX2), 16 (AVX-512)

at::Tensor attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                     const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.dim() == 4, "decode_attention: query [n, H, D], keys/values [n, H_kv, L, D]");
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16, "decode_attention: a bf16 cache");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: keys/values contiguous in D");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(1), length = keys.size(2), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(0) == rows && keys.size(3) == dim && values.sizes() == keys.sizes(),
              "decode_attention: shapes");
  const at::Tensor q = (query.to(at::kFloat) * scale).contiguous();  // [n, H, D]
  at::Tensor bool_mask;
  if (mask.has_value() && mask->defined()) {
    bool_mask = mask->to(at::kBool).contiguous();
    TORCH_CHECK(bool_mask.dim() == 2 && bool_mask.size(0) == rows && bool_mask.size(1) == length, "decode_attention: mask [n, L]");
  }
  const int64_t width = std::max(length, kSoftmaxMinWidth);
  at::Tensor scores = at::empty({rows, kv_heads, group, width}, q.options());
  if (width > length) scores.narrow(-1, length, width - length).fill_(-std::numeric_limits<float>::infinity());
  const float* q_data = q.data_ptr<float>();
  float* score_data = scores.data_ptr<float>();
  const auto* key_data = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  const auto* value_data = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  const bool* mask_data = bool_mask.defined() ? bool_mask.data_ptr<bool>() : nullptr;
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads;
      group_scores(q_data + (row * heads + head * group) * dim, key_data + row * ks0 + head * ks1, ks2,
                   mask_data != nullptr ? mask_data + row * length : nullptr, score_data + task * group * width,
                   group, length, width, dim, wide.data());
    }
  });
  const at::Tensor weights = at::_softmax(scores, -1, false);  // [n, H_kv, G, width]
  const float* weight_data = weights.data_ptr<float>();
  at::Tensor result = at::zeros({rows, heads, dim}, q.options());
  float* result_data = result.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads;
      group_values(weight_data + task * group * width, value_data + row * vs0 + head * vs1, vs2,
                   mask_data != nullptr ? mask_data + row * length : nullptr,
                   result_data + (row * heads + head * group) * dim, group, length, width, dim, wide.data());
    }
  });
  return result;
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const std::optional<at::Tensor>& mask, double scale) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return attention(query, keys, values, mask, scale);
}

// x @ W.T from a weight packed for oneDNN (torch.ops.mkldnn._reorder_linear_weight), x cast to bf16:
// packed_linear.packed_product.
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& weight) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x.to(at::kBFloat16), weight, c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// LlamaRMSNorm / Qwen3RMSNorm's forward as written: fp32 statistics, the normalised values back in
// the input's dtype, times the fp32 weight (decode_step._rms_norm).
at::Tensor written_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor wide = x.to(at::kFloat);
  const at::Tensor normalised = wide * at::rsqrt(wide.pow(2).mean(-1, true) + eps);
  return weight * normalised.to(x.scalar_type());
}

// The residual stream's norm: torch.rms_norm where the caller checked it equals the written-out form.
at::Tensor residual_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool fused) {
  return fused ? at::rms_norm(x, {x.size(-1)}, weight, eps) : written_norm(x, weight, eps);
}

// One decoding step (decode_step.FusedDecodeStep.__call__ after the embedding and the rotary tables):
// x fp32 [n, hidden] (the new tokens' embeddings), cos/signed_sin fp32 [n, 1, D];
// weights: per block the packed q|k|v, o, gate|up and down weights, then the head's;
// norms: per block the input and post-attention norm weights (and Qwen3's query and key head norms),
// then the final norm's; key_caches/value_caches: per block bf16 [n, H_kv, L + 1, D] views of the cache
// whose last position this step writes; mask bool [n, L + 1] or none.
// Returns (logits bf16 [n, V], block `captured`'s output fp32 [n, hidden], or an empty tensor).
std::tuple<at::Tensor, at::Tensor> decode_step(
    const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList weights,
    at::TensorList norms, at::TensorList key_caches, at::TensorList value_caches, const std::optional<at::Tensor>& mask,
    int64_t heads, int64_t kv_heads, double eps, double head_norm_eps, double scaling, bool fused_norm,
    bool head_norms, int64_t captured) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const int64_t blocks = static_cast<int64_t>(key_caches.size());
  const int64_t norms_per_block = head_norms ? 4 : 2;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * blocks + 1 && static_cast<int64_t>(value_caches.size()) == blocks &&
              static_cast<int64_t>(norms.size()) == norms_per_block * blocks + 1, "decode_step: weights/norms/caches per block");
  const int64_t rows = embedded.size(0), dim = key_caches[0].size(3), half = dim / 2;
  const int64_t last = key_caches[0].size(2) - 1;  // the position this step writes
  std::optional<at::Tensor> step_mask = mask;
  at::Tensor x = embedded, state;
  for (int64_t block = 0; block < blocks; ++block) {
    const at::Tensor* norm = norms.data() + block * norms_per_block;
    const at::Tensor* weight = weights.data() + block * 4;
    const at::Tensor qkv = packed_product(residual_norm(x, norm[0], eps, fused_norm), weight[0]).view({rows, heads + 2 * kv_heads, dim});
    at::Tensor qk = head_norms
        ? at::cat({written_norm(qkv.slice(1, 0, heads), norm[2], head_norm_eps),
                   written_norm(qkv.slice(1, heads, heads + kv_heads), norm[3], head_norm_eps)}, 1)
        : qkv.slice(1, 0, heads + kv_heads);
    qk = qk * cos + at::cat({qk.slice(-1, half), qk.slice(-1, 0, half)}, -1) * signed_sin;  // [n, H + H_kv, D] fp32
    key_caches[block].select(2, last).copy_(qk.slice(1, heads).to(at::kBFloat16));
    value_caches[block].select(2, last).copy_(qkv.slice(1, heads + kv_heads));
    const at::Tensor out = attention(qk.slice(1, 0, heads), key_caches[block], value_caches[block], step_mask, scaling);
    x = x + packed_product(out.reshape({rows, heads * dim}), weight[1]);
    const at::Tensor gate_up = packed_product(residual_norm(x, norm[1], eps, fused_norm), weight[2]);
    const int64_t inner = gate_up.size(-1) / 2;
    x = x + packed_product(at::silu(gate_up.slice(1, 0, inner)) * gate_up.slice(1, inner), weight[3]);
    if (block == captured) state = x;
  }
  const at::Tensor logits = packed_product(residual_norm(x, norms[norms.size() - 1], eps, fused_norm), weights[weights.size() - 1]);
  return {logits, state.defined() ? state : at::empty({0}, x.options())};
}

}  // namespace

TORCH_LIBRARY(spader_native, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor", &decode_attention);
  m.def("decode_step(Tensor embedded, Tensor cos, Tensor signed_sin, Tensor[] weights, Tensor[] norms, "
        "Tensor[] key_caches, Tensor[] value_caches, Tensor? mask, int heads, int kv_heads, float eps, "
        "float head_norm_eps, float scaling, bool fused_norm, bool head_norms, int captured) -> (Tensor, Tensor)",
        &decode_step);
}
