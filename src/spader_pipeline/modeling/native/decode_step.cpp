// One decoding step of a Llama-family decoder on the CPU, in C++: spader_pipeline/modeling/decode_step.py's
// FusedDecodeStep without Python between its operations, and the decoding attention over a bf16 cache as
// two loops around ATen's softmax.
//
// Built once per machine by spader_pipeline/modeling/native_step.py (torch.utils.cpp_extension, -O3
// -march=native -ffp-contract=off) and registered as the operators spader_native::decode_attention and
// spader_native::decode_step. The step computes what the Python step computes, rounding for rounding, so
// its logits are the Python step's bit for bit (tests/modeling/test_modeling_decode_step.py): the products
// are the same packed oneDNN calls, the norm's sum of squares is ATen's sum, SiLU is ATen's silu and the
// softmax ATen's softmax; everything else is elementwise (the residual additions, the norm's scaling, the
// rotary embedding, the bf16 casts, SwiGLU's product), written here as loops over the step's few values.
// At one row those loops replace some 700 small operator calls a step, each of which costs more than its
// arithmetic (docs/performance.md). They round each product and sum on its own, as ATen's kernels do:
// the file is built without contracting a product and a sum into one fused multiply-add, and the
// attention's loops, which do want one, write it out (std::fma, _mm512_fmadd_ps). A cast to bf16 rounds
// to nearest, ties to even, as ATen's does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
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
    for (int j = 0; j < 16; ++j) lanes[j] = std::fma(a[d + j], b[d + j], lanes[j]);
  for (int width = 8; width > 0; width /= 2)  // a tree over the lanes: vector adds, not 16 dependent ones
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  float sum = lanes[0];
  for (; d < dim; ++d) sum = std::fma(a[d], b[d], sum);
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
      for (int64_t d = 0; d < dim; ++d) o[d] = std::fma(w, wide[d], o[d]);
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

// The attention over prepared inputs: `q` fp32 [n, H, D] contiguous, already scaled; `mask` bool [n, L]
// contiguous or nullptr. Returns fp32 [n, H, D].
at::Tensor attend(const float* q_data, const at::Tensor& keys, const at::Tensor& values, const bool* mask_data,
                  int64_t rows, int64_t heads, const at::TensorOptions& options) {
  const int64_t kv_heads = keys.size(1), length = keys.size(2), dim = keys.size(3), group = heads / kv_heads;
  const int64_t width = std::max(length, kSoftmaxMinWidth);
  at::Tensor scores = at::empty({rows, kv_heads, group, width}, options);
  float* score_data = scores.data_ptr<float>();
  if (width > length) {
    for (int64_t line = 0; line < rows * heads; ++line)
      std::fill(score_data + line * width + length, score_data + (line + 1) * width, -std::numeric_limits<float>::infinity());
  }
  const auto* key_data = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  const auto* value_data = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
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
  at::Tensor result = at::empty({rows, heads, dim}, options);
  float* result_data = result.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads;
      float* out = result_data + (row * heads + head * group) * dim;
      std::fill(out, out + group * dim, 0.f);
      group_values(weight_data + task * group * width, value_data + row * vs0 + head * vs1, vs2,
                   mask_data != nullptr ? mask_data + row * length : nullptr, out, group, length, width, dim, wide.data());
    }
  });
  return result;
}

// The checks of one layer's cache for the attention of `rows` rows of `heads` query heads of `dim` values.
void check_cache(const at::Tensor& keys, const at::Tensor& values, int64_t rows, int64_t heads, int64_t dim) {
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4, "decode_attention: query [n, H, D], keys/values [n, H_kv, L, D]");
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16, "decode_attention: a bf16 cache");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: keys/values contiguous in D");
  TORCH_CHECK(heads % keys.size(1) == 0 && keys.size(0) == rows && keys.size(3) == dim && values.sizes() == keys.sizes(),
              "decode_attention: shapes");
}

// The operator's attention: the query scaled and made contiguous, the mask as bool, then attend.
at::Tensor attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                     const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.dim() == 4, "decode_attention: query [n, H, D], keys/values [n, H_kv, L, D]");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2), length = keys.size(2);
  check_cache(keys, values, rows, heads, dim);
  const at::Tensor q = (query.to(at::kFloat) * scale).contiguous();  // [n, H, D]
  at::Tensor bool_mask;
  if (mask.has_value() && mask->defined()) {
    bool_mask = mask->to(at::kBool).contiguous();
    TORCH_CHECK(bool_mask.dim() == 2 && bool_mask.size(0) == rows && bool_mask.size(1) == length, "decode_attention: mask [n, L]");
  }
  return attend(q.data_ptr<float>(), keys, values, bool_mask.defined() ? bool_mask.data_ptr<bool>() : nullptr, rows, heads,
                q.options());
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

// fp32 -> bf16 as ATen rounds it: to nearest, ties to even.
inline uint16_t narrow(float value) { return c10::BFloat16(value).x; }

// x fp32 += pending bf16 (the same shape, contiguous), in place, as x + pending rounds; nothing where
// pending is undefined.
void add_in_place(const at::Tensor& x, const at::Tensor& pending) {
  if (!pending.defined()) return;
  TORCH_CHECK(pending.is_contiguous() && pending.numel() == x.numel(), "decode_step: a product's output, [n, hidden]");
  float* data = x.data_ptr<float>();
  const auto* add = reinterpret_cast<const uint16_t*>(pending.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < x.numel(); ++i) data[i] = data[i] + widen(add[i]);
}

// The residual stream's norm as the model's norm module writes it (written_norm: fp32 statistics, times
// the fp32 weight), cast to bf16 as the next product casts its input: weight * (x * rsqrt(mean(x^2) + eps))
// over each row, the mean ATen's sum of the squares divided by the width. Where `pending` (bf16 [n, h]) is
// defined, it is first added to x in place: the residual addition of the block's last product.
// x fp32 [n, h] contiguous, weight fp32 [h] contiguous -> bf16 [n, h].
at::Tensor add_and_norm(const at::Tensor& x, const at::Tensor& pending, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), width = x.size(1), count = rows * width;
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == width,
              "decode_step: a residual norm's weight, fp32 [hidden]");
  float* data = x.data_ptr<float>();
  at::Tensor squares = at::empty_like(x);
  float* square = squares.data_ptr<float>();
  add_in_place(x, pending);
  for (int64_t i = 0; i < count; ++i) square[i] = data[i] * data[i];
  const at::Tensor sums = at::sum(squares, 1);  // [n]: the mean's sum, in ATen's order of additions
  const float* sum = sums.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kBFloat16));
  auto* result = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t row = 0; row < rows; ++row) {
    const float mean = sum[row] / static_cast<float>(width);
    const float shifted = mean + static_cast<float>(eps);
    const float scale = 1.f / std::sqrt(shifted);
    const float* in = data + row * width;
    uint16_t* o = result + row * width;
    for (int64_t j = 0; j < width; ++j) {
      const float normalised = in[j] * scale;
      o[j] = narrow(w[j] * normalised);
    }
  }
  return out;
}

// The rotary embedding of the step's query and key heads in fp32 (qk * cos + rotate_half(qk) * sin, the
// sign of rotate_half carried by signed_sin), its keys and the step's values written to the cache's position
// `last` in bf16, and its queries returned scaled as the attention scales them: fp32 [n, H, D].
// qk: [n, H + H_kv, D] bf16 (the product's own columns) or fp32 (Qwen3's, normed per head), `values` bf16
// [n, H_kv, D], both with their last dimension contiguous; cos/sin fp32 [n, D] contiguous.
template <typename Source>
at::Tensor rotate_and_store(const Source* qk, int64_t qk_row_stride, int64_t qk_head_stride, const uint16_t* values,
                            int64_t value_row_stride, int64_t value_head_stride, const float* cos, const float* sin,
                            const at::Tensor& key_cache, const at::Tensor& value_cache, int64_t last, int64_t rows,
                            int64_t heads, int64_t kv_heads, int64_t dim, float scale, const at::TensorOptions& options) {
  const int64_t half = dim / 2;
  at::Tensor queries = at::empty({rows, heads, dim}, options);
  float* query = queries.data_ptr<float>();
  auto* keys = reinterpret_cast<uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  auto* cached_values = reinterpret_cast<uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1), vs2 = value_cache.stride(2);
  const auto wide = [](Source v) -> float {
    if constexpr (std::is_same_v<Source, uint16_t>) return widen(v); else return v;
  };
  for (int64_t row = 0; row < rows; ++row) {
    const float* c = cos + row * dim;
    const float* s = sin + row * dim;
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      const Source* in = qk + row * qk_row_stride + head * qk_head_stride;
      for (int64_t d = 0; d < dim; ++d) {
        const float straight = wide(in[d]) * c[d];
        const float turned = wide(in[d < half ? d + half : d - half]) * s[d];
        const float rotated = straight + turned;
        if (head < heads) query[(row * heads + head) * dim + d] = rotated * scale;
        else keys[row * ks0 + (head - heads) * ks1 + last * ks2 + d] = narrow(rotated);
      }
    }
    for (int64_t head = 0; head < kv_heads; ++head)
      std::memcpy(cached_values + row * vs0 + head * vs1 + last * vs2,
                  values + row * value_row_stride + head * value_head_stride, dim * sizeof(uint16_t));
  }
  return queries;
}

// The attention's output fp32 [n, H, D] as the next product's bf16 input [n, H * D].
at::Tensor narrowed(const at::Tensor& x) {
  at::Tensor out = at::empty({x.size(0), x.numel() / x.size(0)}, x.options().dtype(at::kBFloat16));
  const float* in = x.data_ptr<float>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = narrow(in[i]);
  return out;
}

// SwiGLU's product silu(gate) * up in bf16 (ATen's bf16 product: fp32, rounded to bf16), from ATen's own
// silu of the gate (its exp); gate_up bf16 [n, 2 I] -> bf16 [n, I].
at::Tensor gated(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous(), "decode_step: the gate|up product's output, contiguous");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  const at::Tensor activated = at::silu(gate_up.slice(1, 0, inner)).contiguous();  // bf16 [n, I]
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  const auto* a = reinterpret_cast<const uint16_t*>(activated.data_ptr<at::BFloat16>());
  const auto* up = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t j = 0; j < inner; ++j)
      o[row * inner + j] = narrow(widen(a[row * inner + j]) * widen(up[row * 2 * inner + inner + j]));
  return out;
}

// One decoding step (decode_step.FusedDecodeStep.__call__ after the embedding and the rotary tables),
// the residual stream in one fp32 buffer that each block's products are added to in place:
// x fp32 [n, hidden] (the new tokens' embeddings), cos/signed_sin fp32 [n, 1, D];
// weights: per block the packed q|k|v, o, gate|up and down weights, then the head's;
// norms: per block the input and post-attention norm weights (and Qwen3's query and key head norms),
// then the final norm's; key_caches/value_caches: per block bf16 [n, H_kv, L + 1, D] views of the cache
// whose last position this step writes; mask bool [n, L + 1] or none.
// Returns (logits bf16 [n, V], block `captured`'s output fp32 [n, hidden], or an empty tensor).
std::tuple<at::Tensor, at::Tensor> decode_step(
    const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList weights,
    at::TensorList norms, at::TensorList key_caches, at::TensorList value_caches, const std::optional<at::Tensor>& mask,
    int64_t heads, int64_t kv_heads, double eps, double head_norm_eps, double scaling, bool head_norms,
    int64_t captured) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const int64_t blocks = static_cast<int64_t>(key_caches.size());
  const int64_t norms_per_block = head_norms ? 4 : 2;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * blocks + 1 && static_cast<int64_t>(value_caches.size()) == blocks &&
              static_cast<int64_t>(norms.size()) == norms_per_block * blocks + 1, "decode_step: weights/norms/caches per block");
  const int64_t rows = embedded.size(0), dim = key_caches[0].size(3);
  const int64_t last = key_caches[0].size(2) - 1;  // the position this step writes
  const at::Tensor cos_rows = cos.to(at::kFloat).reshape({rows, dim}).contiguous();
  const at::Tensor sin_rows = signed_sin.to(at::kFloat).reshape({rows, dim}).contiguous();
  at::Tensor bool_mask;
  if (mask.has_value() && mask->defined()) {
    bool_mask = mask->to(at::kBool).contiguous();
    TORCH_CHECK(bool_mask.dim() == 2 && bool_mask.size(0) == rows && bool_mask.size(1) == last + 1, "decode_step: mask [n, L + 1]");
  }
  const bool* mask_data = bool_mask.defined() ? bool_mask.data_ptr<bool>() : nullptr;
  const at::TensorOptions fp32 = embedded.options().dtype(at::kFloat);
  at::Tensor x = embedded.to(at::kFloat).contiguous().clone();  // the residual stream, updated in place
  at::Tensor pending, state;  // pending: the last product's output, not yet added to x
  for (int64_t block = 0; block < blocks; ++block) {
    const at::Tensor* norm = norms.data() + block * norms_per_block;
    const at::Tensor* weight = weights.data() + block * 4;
    check_cache(key_caches[block], value_caches[block], rows, heads, dim);
    const at::Tensor qkv = packed_product(add_and_norm(x, pending, norm[0], eps), weight[0]).view({rows, heads + 2 * kv_heads, dim});
    const auto* value_bits = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>()) + (heads + kv_heads) * dim;
    // the query and key heads rotated from `source` ([n, >= H + H_kv, D] as `layout`), the cache written
    const auto rotate = [&](const auto* source, const at::Tensor& layout) {
      return rotate_and_store(source, layout.stride(0), layout.stride(1), value_bits, qkv.stride(0), qkv.stride(1),
                              cos_rows.data_ptr<float>(), sin_rows.data_ptr<float>(), key_caches[block], value_caches[block],
                              last, rows, heads, kv_heads, dim, static_cast<float>(scaling), fp32);
    };
    at::Tensor queries;
    if (head_norms) {
      const at::Tensor qk = at::cat({written_norm(qkv.slice(1, 0, heads), norm[2], head_norm_eps),
                                     written_norm(qkv.slice(1, heads, heads + kv_heads), norm[3], head_norm_eps)}, 1).contiguous();
      queries = rotate(qk.data_ptr<float>(), qk);
    } else {
      queries = rotate(reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>()), qkv);
    }
    const at::Tensor out = attend(queries.data_ptr<float>(), key_caches[block], value_caches[block], mask_data, rows, heads, fp32);
    pending = packed_product(narrowed(out), weight[1]);
    const at::Tensor gate_up = packed_product(add_and_norm(x, pending, norm[1], eps), weight[2]);
    pending = packed_product(gated(gate_up), weight[3]);
    if (block == captured) {  // the block's output: x with its last product added
      add_in_place(x, pending);
      pending = at::Tensor();
      state = x.clone();
    }
  }
  const at::Tensor logits = packed_product(add_and_norm(x, pending, norms[norms.size() - 1], eps), weights[weights.size() - 1]);
  return {logits, state.defined() ? state : at::empty({0}, x.options())};
}

}  // namespace

TORCH_LIBRARY(spader_native, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor", &decode_attention);
  m.def("decode_step(Tensor embedded, Tensor cos, Tensor signed_sin, Tensor[] weights, Tensor[] norms, "
        "Tensor[] key_caches, Tensor[] value_caches, Tensor? mask, int heads, int kv_heads, float eps, "
        "float head_norm_eps, float scaling, bool head_norms, int captured) -> (Tensor, Tensor)",
        &decode_step);
}
