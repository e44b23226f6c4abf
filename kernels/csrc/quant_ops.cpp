// loraplex's native quantized matmuls with 8-bit activations, for CPUs that multiply int8 natively (VNNI, AMX):
// kernels/quant_int8.py and kernels/quant_int4.py hold the torch references (decision 0039). Built with cpu_ops.cpp
// into one library (kernels/native.py), which declares the schemas.

#include "common.h"

using namespace loraplex_cpu;

namespace {

inline float abs_max(const float* __restrict x, int64_t n) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 acc = _mm256_setzero_ps();
  for (; k + 8 <= n; k += 8) acc = _mm256_max_ps(acc, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// q[k] = rint(x[k] * inv) (to nearest, ties to even, as torch.round), for values that fit int8.
inline void quantize_row(const float* __restrict x, int8_t* __restrict q, float inv, int64_t n) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 v = _mm256_set1_ps(inv);
  // packs works within 128-bit lanes: this puts the 4-byte groups back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; k + 32 <= n; k += 32) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), v));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), v));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 16), v));
    const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 24), v));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permutevar8x32_epi32(packed, order));
  }
#endif
  for (; k < n; ++k) q[k] = static_cast<int8_t>(std::lrintf(x[k] * inv));
}

}  // namespace

// W8A8 linear: each row of x quantized on the fly to int8 with its own symmetric scale, an integer product with the
// weight's int8 codes (at::_int_mm: int32 accumulators, exact), the result scaled by the row's and the channel's
// scale: y[m, n] = float(acc[m, n]) * sx[m] * sw[n] (+ bias[n]) (+ residual[m, n]), where sx[m] =
// max(max|x[m, :]|, FLT_MIN) / 127 and q[m, k] = rint(x[m, k] * (1 / sx[m])). The same arithmetic, in the same
// order, as kernels/quant_int8.py's int8_linear_dynamic (the reference): one pass over x and one over y instead of
// the eight elementwise ops there.
at::Tensor int8_linear_dynamic(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  check_f32(x, "x");
  check_f32(scales, "scales");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [num_tokens, in_features] tensor");
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar && qweight.dim() == 2 &&
                  qweight.is_contiguous() && qweight.size(1) == x.size(1),
              "qweight must be a contiguous int8 [out_features, in_features] tensor matching x");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = qweight.size(0);
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == out_features && scales.is_contiguous(), "scales must be [out]");
  const float* b = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous(), "bias must be [out]");
    b = bias->data_ptr<float>();
  }
  const float* r = nullptr;
  if (residual.has_value()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == out_features &&
                    residual->is_contiguous(),
                "residual must be a contiguous [num_tokens, out_features] tensor");
    r = residual->data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  at::Tensor xq = at::empty({rows, in_features}, x.options().dtype(at::kChar));
  std::vector<float> sx(rows);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(in_features, 1));
  at::parallel_for(0, rows, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * in_features;
      const float scale = std::max(abs_max(row, in_features), std::numeric_limits<float>::min()) / 127.f;
      sx[m] = scale;
      quantize_row(row, qp + m * in_features, 1.f / scale, in_features);
    }
  });
  const at::Tensor acc = at::_int_mm(xq, qweight.t());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const int64_t acc_stride = acc.stride(0);
  const float* sw = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / out_features), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* a = ap + m * acc_stride;
      float* out = yp + m * out_features;
      const float s = sx[m];
#pragma omp simd
      for (int64_t n = 0; n < out_features; ++n) out[n] = static_cast<float>(a[n]) * s * sw[n];
      if (b != nullptr) axpy(out, b, 1.f, out_features);
      if (r != nullptr) axpy(out, r + m * out_features, 1.f, out_features);
    }
  });
  return y;
}

// One int4 row's int8 scale, S = max(largest |value|, FLT_MIN) / 127, and per group the int8 value of each of the 16
// codes, rint((q - zero) * (scale_g * (1 / S))), into luts[16 * g + q]. Without -ffast-math: the reference's float32
// arithmetic exactly (regrouped products round ties of the codes the other way).
__attribute__((optimize("no-fast-math"))) float int4_row_tables(const float* s, const float* z, int64_t groups,
                                                                 int8_t* luts) {
  float largest = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    largest = std::max(largest, s[g] * std::max(std::fabs(z[g]), std::fabs(15.f - z[g])));
  }
  const float scale = std::max(largest, std::numeric_limits<float>::min()) / 127.f;
  const float inv = 1.f / scale;
  int64_t g = 0;
#if defined(__AVX2__)
  const __m256 low = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), high = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  alignas(32) int32_t values[16];
  for (; g < groups; ++g) {  // rounds to nearest even, as rint in the default rounding mode
    const __m256 zero = _mm256_set1_ps(z[g]), factor = _mm256_set1_ps(s[g] * inv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(values),
                       _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(low, zero), factor)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(values + 8),
                       _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(high, zero), factor)));
    for (int q = 0; q < 16; ++q) luts[16 * g + q] = static_cast<int8_t>(values[q]);
  }
#endif
  for (; g < groups; ++g) {
    const float factor = s[g] * inv;
    for (int q = 0; q < 16; ++q) luts[16 * g + q] = static_cast<int8_t>(std::nearbyint((q - z[g]) * factor));
  }
  return scale;
}

// W4A8 linear over the int4 format of kernels/quant.py (codes 0..15, two per byte, the even column in the low nibble;
// a scale and a zero point per group of `group_size` inputs). Per call, each output row's int4 values are requantized
// to int8 on one symmetric scale for the row, S[n] = max_g(scales[n, g] * max(|zeros[n, g]|, |15 - zeros[n, g]|))
// / 127 (the row's largest |value|), c[n, k] = rint((q[n, k] - zeros[n, g]) * (scales[n, g] * (1 / S[n]))), into a
// buffer dropped after the call; then the int8 path: x quantized per row, one integer product, y = float(acc) *
// sx[m] * S[n] (+ bias) (+ residual). One product instead of one per group (each a small, slower _int_mm), for an
// extra rounding of at most half an int8 step, S[n] / 2, a small fraction of the int4 step. kernels/quant_int4.py's
// int4_linear_dynamic is the reference.
at::Tensor int4_linear_dynamic(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual) {
  check_f32(scales, "scales");
  check_f32(zeros, "zeros");
  const int64_t in_features = x.size(-1), out_features = packed.size(0);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous() && 2 * packed.size(1) == in_features,
              "packed must be a contiguous uint8 [out_features, in_features / 2] tensor matching x");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && in_features % group_size == 0, "bad group_size");
  const int64_t groups = in_features / group_size, half = group_size / 2;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out_features && scales.size(1) == groups &&
                  scales.is_contiguous() && zeros.sizes() == scales.sizes() && zeros.is_contiguous(),
              "scales and zeros must be contiguous [out_features, groups]");
  at::Tensor codes = at::empty({out_features, in_features}, packed.options().dtype(at::kChar));
  at::Tensor row_scales = at::empty({out_features}, scales.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* rs = row_scales.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t n0, int64_t n1) {
    std::vector<int8_t> tables(groups * 16 + 16);
    int8_t* aligned = tables.data() + (16 - reinterpret_cast<uintptr_t>(tables.data()) % 16) % 16;
    for (int64_t n = n0; n < n1; ++n) {
      rs[n] = int4_row_tables(sp + n * groups, zp + n * groups, groups, aligned);
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* lut = aligned + 16 * g;
        const uint8_t* src = pp + n * (in_features / 2) + g * half;
        int8_t* dst = cp + n * in_features + g * group_size;
        int64_t j = 0;
#if defined(__AVX2__)
        // 16 bytes -> 32 codes: each nibble looks its value up in the group's table (pshufb), then the low and
        // high nibbles' values are interleaved back into column order.
        const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(lut));
        const __m128i low_mask = _mm_set1_epi8(0x0F);
        for (; j + 16 <= half; j += 16) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
          const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low_mask));
          const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j), _mm_unpacklo_epi8(lo, hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j + 16), _mm_unpackhi_epi8(lo, hi));
        }
#endif
        for (; j < half; ++j) {
          dst[2 * j] = lut[src[j] & 0xF];
          dst[2 * j + 1] = lut[src[j] >> 4];
        }
      }
    }
  });
  return int8_linear_dynamic(x, codes, row_scales, bias, residual);
}

TORCH_LIBRARY_IMPL(loraplex_cpu, CPU, m) {
  m.impl("int8_linear_dynamic", &int8_linear_dynamic);
  m.impl("int4_linear_dynamic", &int4_linear_dynamic);
}
