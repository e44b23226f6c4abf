// loraplex's native CPU operators (kernels/native.py builds this file and quant_ops.cpp at install time and loads
// them).
//
// Two hot loops of CPU decode that torch ops can only express as many tiny calls (the quantized matmuls with 8-bit
// activations are in quant_ops.cpp):
// - decode_attention: one query per sequence over its paged K/V, read in place from the pool (no gathered copy),
//   one pass with an online softmax per (sequence, kv head), the group's query heads sharing each key and value read;
// - lora_add: every adapter segment's shrink (x @ A^T) and expands (h @ B^T) of one fused projection in one call,
//   reading A and B^T where they lie in the pool.
// Both split their work over torch's own thread pool (at::parallel_for), so they never contend with a second
// OpenMP runtime. The torch paths (kernels/paged_attention.py, kernels/sgmv_*.py) define the semantics and stay
// the reference the tests compare against. float32 only: the CPU engine's dtype for speed.

#include "common.h"

namespace {

using namespace loraplex_cpu;

// Split [0, n) items of the given costs into `parts` runs of about equal cost; returns parts + 1 boundaries.
std::vector<int64_t> balanced_runs(const std::vector<double>& cost, int64_t parts) {
  const int64_t n = static_cast<int64_t>(cost.size());
  double total = 0;
  for (double c : cost) total += c;
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  double seen = 0;
  int64_t part = 1;
  for (int64_t i = 0; i < n && part < parts; ++i) {
    seen += cost[i];
    while (part < parts && seen >= total * part / parts) bounds[part++] = i + 1;
  }
  return bounds;
}

}  // namespace

using namespace loraplex_cpu;

#if defined(__AVX2__) && defined(__FMA__)
// Eight sums of eight lanes each, as one vector: lane i holds the sum of v[i]'s lanes.
inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[t] = q . keys[t] for t < count, dim a multiple of 8: eight keys at a time, one accumulator each, so the
// FMAs of eight independent chains overlap.
inline void scores_avx2(const float* __restrict q, const float* __restrict keys, int64_t count, int64_t dim,
                        float* __restrict scores) {
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + (t + i) * dim + d), acc[i]);
    }
    _mm256_storeu_ps(scores + t, sum_lanes8(acc));
  }
  for (; t < count; ++t) scores[t] = dot(q, keys + t * dim, dim);
}

// acc[:dim] += sum_t p[t] * values[t] for t < count, dim a multiple of 8: the accumulator stays in registers over
// the block, 64 columns at a time.
template <int VECS>
inline void weighted_sum_avx2_cols(float* __restrict acc, const float* __restrict values, const float* __restrict p,
                                   int64_t count, int64_t dim) {
  __m256 a[VECS];
  for (int i = 0; i < VECS; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < count; ++t) {
    const __m256 w = _mm256_broadcast_ss(p + t);
    const float* row = values + t * dim;
    for (int i = 0; i < VECS; ++i) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * i), a[i]);
  }
  for (int i = 0; i < VECS; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

inline void weighted_sum_avx2(float* __restrict acc, const float* __restrict values, const float* __restrict p,
                              int64_t count, int64_t dim) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) weighted_sum_avx2_cols<8>(acc + d, values + d, p, count, dim);
  for (; d < dim; d += 8) weighted_sum_avx2_cols<1>(acc + d, values + d, p, count, dim);
}
#endif

// The first key a decode query at position len - 1 sees: 0, or the start of its window of `window` keys.
inline int64_t first_key(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(len - window, 0) : 0; }

// One (sequence, kv head): the group's queries over the sequence's keys from position `first` (0, or the start of a
// sliding window) to len - 1, an online softmax per block; softcap > 0 caps each score at softcap * tanh(s / softcap).
void attend_one(const float* __restrict qrow, float* __restrict orow, const float* kp, const float* vp,
                const int32_t* table, int64_t first, int64_t len, int64_t group, int64_t dim, int64_t block_size,
                int64_t k_page, int64_t v_page, int64_t head_offset, float scale, float softcap,
                float* __restrict scratch) {
  float* qs = scratch;                        // [group, dim]
  float* acc = qs + group * dim;              // [group, dim]
  float* scores = acc + group * dim;          // [group, block_size]
  float* m = scores + group * block_size;     // [group]
  float* l = m + group;                       // [group]
  for (int64_t i = 0; i < group * dim; ++i) {
    qs[i] = qrow[i] * scale;
    acc[i] = 0.f;
  }
  for (int64_t g = 0; g < group; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
#if defined(__AVX2__) && defined(__FMA__)
  const bool vectors = dim % 8 == 0;
#endif
  for (int64_t b = first / block_size; b * block_size < len; ++b) {
    const int64_t page = table[b];
    const int64_t skip = std::max<int64_t>(first - b * block_size, 0);  // slots before the window's first key
    const int64_t count = std::min(block_size, len - b * block_size) - skip;
    const float* keys = kp + page * k_page + head_offset + skip * dim;
    const float* values = vp + page * v_page + head_offset + skip * dim;
    if ((b + 1) * block_size < len) {
      // The next block lies on another page: the hardware prefetchers do not follow, so ask for it now.
      const int64_t next = table[b + 1];
      const char* next_keys = reinterpret_cast<const char*>(kp + next * k_page + head_offset);
      const char* next_values = reinterpret_cast<const char*>(vp + next * v_page + head_offset);
      const int64_t bytes = block_size * dim * static_cast<int64_t>(sizeof(float));
      for (int64_t offset = 0; offset < bytes; offset += 64) {
        __builtin_prefetch(next_keys + offset);
        __builtin_prefetch(next_values + offset);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scores + g * block_size;
      float* a = acc + g * dim;
#if defined(__AVX2__) && defined(__FMA__)
      if (vectors) {
        scores_avx2(qs + g * dim, keys, count, dim, sc);
      } else
#endif
        for (int64_t t = 0; t < count; ++t) sc[t] = dot(qs + g * dim, keys + t * dim, dim);
      if (softcap > 0.f) {
        for (int64_t t = 0; t < count; ++t) sc[t] = softcap * std::tanh(sc[t] / softcap);
      }
      float block_max = sc[0];
      for (int64_t t = 1; t < count; ++t) block_max = std::max(block_max, sc[t]);
      const float new_max = std::max(m[g], block_max);
      if (new_max > m[g]) {
        const float correction = std::exp(m[g] - new_max);  // 0 on the first block
        l[g] *= correction;
        scale_in_place(a, correction, dim);
        m[g] = new_max;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < count; ++t) {
        sc[t] = std::exp(sc[t] - new_max);
        sum += sc[t];
      }
      l[g] += sum;
#if defined(__AVX2__) && defined(__FMA__)
      if (vectors) {
        weighted_sum_avx2(a, values, sc, count, dim);
        continue;
      }
#endif
      for (int64_t t = 0; t < count; ++t) axpy(a, values + t * dim, sc[t], dim);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t d = 0; d < dim; ++d) orow[g * dim + d] = acc[g * dim + d] * inv;
  }
}

// out[tokens[s], h] = softmax(scale * q[tokens[s], h] . K_s) V_s for every decode sequence s and head h.
// q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_pages, num_kv_heads, block_size, head_dim]
// with the last three dimensions contiguous (any page stride: the pool's K and V views); block_tables: [n, max_blocks]
// int32; ctx_lens, tokens: [n] int64. Slots past a sequence's length are never read.
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& ctx_lens, const at::Tensor& tokens,
                      double scale, int64_t window, double softcap, const at::Tensor& out) {
  check_f32(q, "q");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  check_f32(out, "out");
  check_i64(ctx_lens, "ctx_lens");
  check_i64(tokens, "tokens");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.sizes() == q.sizes() && out.is_contiguous(),
              "q and out must be contiguous [num_tokens, num_heads, head_dim] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache: [pages, kv_heads, block, dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int32 [n, max_blocks] with contiguous rows");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_pages = k_cache.size(0), num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes of q and the cache differ");
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->stride(3) == 1 && t->stride(2) == head_dim && t->stride(1) == block_size * head_dim,
                "each page's [kv_heads, block, dim] must be contiguous");
  }
  const int64_t n = ctx_lens.size(0);
  TORCH_CHECK(tokens.size(0) == n && block_tables.size(0) == n, "one ctx_len, token and block-table row per sequence");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t* rows = tokens.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "sequence ", s, ": context ", lens[s],
                " outside [1, blocks * block_size]");
    TORCH_CHECK(rows[s] >= 0 && rows[s] < q.size(0), "sequence ", s, ": query row out of range");
    for (int64_t b = first_key(lens[s], window) / block_size; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int32_t page = tables[s * table_stride + b];
      TORCH_CHECK(page >= 0 && page < num_pages, "sequence ", s, ": page id ", page, " out of range");
    }
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t k_page = k_cache.stride(0), v_page = v_cache.stride(0), head_stride = block_size * head_dim;
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);

  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * group * head_dim + group * block_size + 2 * group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t offset = (rows[s] * num_heads + kvh * group) * head_dim;
      attend_one(qp + offset, op + offset, kp, vp, tables + s * table_stride, first_key(lens[s], window), lens[s],
                 group, head_dim, block_size, k_page, v_page, kvh * head_stride, fscale, fcap, scratch.data());
    }
  };
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) total += lens[s] - first_key(lens[s], window);
  // Below a few thousand cached tokens a thread team's fork and join costs more than the work.
  if (total * num_kv_heads < 8192 || at::get_num_threads() == 1) {
    work(0, n * num_kv_heads);
    return;
  }
  // Runs of (sequence, kv head) items of about equal context, one per thread.
  std::vector<double> cost(n * num_kv_heads);
  for (int64_t item = 0; item < n * num_kv_heads; ++item) {
    const int64_t len = lens[item / num_kv_heads];
    cost[item] = 1.0 + len - first_key(len, window);
  }
  const int64_t parts = at::get_num_threads();
  const std::vector<int64_t> bounds = balanced_runs(cost, parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) work(bounds[p], bounds[p + 1]);
  });
}

namespace {

#if defined(__AVX512F__)
inline __m512 load_head(const float* p, int64_t k, int64_t n) {
  return n - k >= 16 ? _mm512_loadu_ps(p + k) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - k)) - 1), p + k);
}
#endif

// h[t * rank + j] = x_t . a_j for the segment's `rows` tokens (x_t at x + t * x_stride) and A's `rank` rows. Decode
// segments are a few tokens, and their adapters' weights come from memory, not cache: with AVX-512 each 16-float
// piece of a row of A is loaded once for four tokens (four independent sums, so no FMA waits on the one before).
inline void shrink_rows(const float* x, int64_t x_stride, int64_t rows, const float* a, int64_t rank, int64_t in,
                        float* h) {
#if defined(__AVX512F__)
  for (int64_t t0 = 0; t0 < rows; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, rows - t0);
    const float* x0 = x + t0 * x_stride;
    const float* x1 = x + (t0 + std::min<int64_t>(1, n - 1)) * x_stride;
    const float* x2 = x + (t0 + std::min<int64_t>(2, n - 1)) * x_stride;
    const float* x3 = x + (t0 + std::min<int64_t>(3, n - 1)) * x_stride;
    for (int64_t j = 0; j < rank; ++j) {
      const float* aj = a + j * in;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t k = 0; k < in; k += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(aj + in + k), _MM_HINT_T0);  // the next row, across pages
        const __m512 av = load_head(aj, k, in);
        s0 = _mm512_fmadd_ps(load_head(x0, k, in), av, s0);
        s1 = _mm512_fmadd_ps(load_head(x1, k, in), av, s1);
        s2 = _mm512_fmadd_ps(load_head(x2, k, in), av, s2);
        s3 = _mm512_fmadd_ps(load_head(x3, k, in), av, s3);
      }
      const float sums[4] = {_mm512_reduce_add_ps(s0), _mm512_reduce_add_ps(s1), _mm512_reduce_add_ps(s2),
                             _mm512_reduce_add_ps(s3)};
      for (int64_t i = 0; i < n; ++i) h[(t0 + i) * rank + j] = sums[i];
    }
  }
#else
  for (int64_t j = 0; j < rank; ++j) {
    for (int64_t t = 0; t < rows; ++t) h[t * rank + j] = dot(x + t * x_stride, a + j * in, in);
  }
#endif
}

// y_t[0:out] += sum_j h[t * h_stride + j] * bt_j for the segment's tokens (y_t at y + t * y_stride) and B^T's
// `rank` rows of `out`. Four rows of B^T at a time: a token's outputs are read and written once per four rows, not
// once per row.
inline void expand_rows(float* y, int64_t y_stride, int64_t rows, const float* bt, int64_t rank, int64_t out,
                        const float* h, int64_t h_stride) {
  int64_t j = 0;
  for (; j + 4 <= rank; j += 4) {
    const float* b0 = bt + j * out;
    const float* b1 = b0 + out;
    const float* b2 = b1 + out;
    const float* b3 = b2 + out;
#if defined(__AVX512F__)
    for (int64_t k = 0; k < out; k += 16) {  // the next four rows, ahead of the loads that need them
      for (const float* next : {b0 + 4 * out, b1 + 4 * out, b2 + 4 * out, b3 + 4 * out}) {
        _mm_prefetch(reinterpret_cast<const char*>(next + k), _MM_HINT_T1);
      }
    }
#endif
    for (int64_t t = 0; t < rows; ++t) {
      const float* ht = h + t * h_stride + j;
      const float h0 = ht[0], h1 = ht[1], h2 = ht[2], h3 = ht[3];
      float* __restrict yt = y + t * y_stride;
#pragma omp simd
      for (int64_t k = 0; k < out; ++k) yt[k] += h0 * b0[k] + h1 * b1[k] + h2 * b2[k] + h3 * b3[k];
    }
  }
  for (; j < rank; ++j) {
    for (int64_t t = 0; t < rows; ++t) axpy(y + t * y_stride, bt + j * out, h[t * h_stride + j], out);
  }
}

}  // namespace

// y[start:end, out_start_m:out_end_m] += (x[start:end] @ A^T)[:, hcol_m : hcol_m + rank_m] @ Bt_m for each segment
// (start, end, slot) and each module m of one fused projection, the adapters' matrices read from the pool:
// A [rank, in] at weights[base[slot] + a_offsets[slot]], Bt_m [rank_m, out_m] (B^T, already scaled) at
// weights[base[slot] + modules[m, slot, 0]], modules[m, slot] = (b_offset, rank, h_col), outputs[m] = (start, end).
// x: [num_tokens, in] and y: [num_tokens, fused out], rows contiguous; segments: [k, 3] int64 of slots >= 0 whose
// pages are one ascending run (base >= 0).
void lora_add(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weights, const at::Tensor& segments,
              const at::Tensor& bases, const at::Tensor& a_offsets, const at::Tensor& a_ranks,
              const at::Tensor& outputs, const at::Tensor& modules) {
  check_f32(x, "x");
  check_f32(y, "y");
  check_f32(weights, "weights");
  for (const at::Tensor* t : {&segments, &bases, &a_offsets, &a_ranks, &outputs, &modules}) check_i64(*t, "tables");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "x and y must be [num_tokens, features] with contiguous rows");
  TORCH_CHECK(weights.dim() == 1 && weights.is_contiguous(), "weights must be the flat pool storage");
  const int64_t num_tokens = x.size(0), in_features = x.size(1), num_slots = bases.size(0);
  const int64_t num_modules = outputs.size(0), num_segments = segments.size(0);
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3, "segments must be [k, 3]");
  TORCH_CHECK(a_offsets.size(0) == num_slots && a_ranks.size(0) == num_slots, "one A offset and rank per slot");
  TORCH_CHECK(outputs.dim() == 2 && outputs.size(1) == 2 && modules.dim() == 3 && modules.size(0) == num_modules &&
                  modules.size(1) == num_slots && modules.size(2) == 3,
              "outputs [modules, 2] and modules [modules, slots, 3]");
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t* base = bases.data_ptr<int64_t>();
  const int64_t* a_off = a_offsets.data_ptr<int64_t>();
  const int64_t* a_rank = a_ranks.data_ptr<int64_t>();
  const int64_t* outs = outputs.data_ptr<int64_t>();
  const int64_t* mods = modules.data_ptr<int64_t>();
  const int64_t pool = weights.numel();
  std::vector<double> cost(num_segments);
  int64_t max_rank = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    const int64_t start = seg[3 * i], end = seg[3 * i + 1], slot = seg[3 * i + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= num_tokens, "segment ", i, " outside the tokens");
    TORCH_CHECK(0 <= slot && slot < num_slots && base[slot] >= 0, "segment ", i, ": slot ", slot,
                " is not a contiguous slot");
    const int64_t rank = a_rank[slot];
    TORCH_CHECK(rank >= 0 && base[slot] + a_off[slot] + rank * in_features <= pool, "slot ", slot, ": A past the pool");
    double work = static_cast<double>(rank) * in_features;
    for (int64_t m = 0; m < num_modules; ++m) {
      const int64_t* entry = mods + (m * num_slots + slot) * 3;
      const int64_t out_m = outs[2 * m + 1] - outs[2 * m];
      TORCH_CHECK(0 <= outs[2 * m] && outs[2 * m] <= outs[2 * m + 1] && outs[2 * m + 1] <= y.size(1),
                  "module ", m, ": columns outside y");
      TORCH_CHECK(entry[1] >= 0 && entry[2] >= 0 && entry[2] + entry[1] <= rank, "module ", m, ", slot ", slot,
                  ": columns outside the shrink");
      TORCH_CHECK(base[slot] + entry[0] + entry[1] * out_m <= pool, "module ", m, ", slot ", slot,
                  ": B past the pool");
      work += static_cast<double>(entry[1]) * out_m;
    }
    cost[i] = work * (end - start) + 1.0;
    max_rank = std::max(max_rank, rank);
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);

  auto work = [&](int64_t begin, int64_t end_segment) {
    std::vector<float> h;
    for (int64_t i = begin; i < end_segment; ++i) {
      const int64_t start = seg[3 * i], end = seg[3 * i + 1], slot = seg[3 * i + 2];
      const int64_t rows = end - start, rank = a_rank[slot];
      if (rows == 0 || rank == 0) continue;
      h.assign(rows * rank, 0.f);
      const float* a = w + base[slot] + a_off[slot];
      // Shrink: each row of A is read once and used by every token of the segment.
      shrink_rows(xp + start * x_stride, x_stride, rows, a, rank, in_features, h.data());
      for (int64_t m = 0; m < num_modules; ++m) {
        const int64_t* entry = mods + (m * num_slots + slot) * 3;
        const int64_t rank_m = entry[1], col = entry[2], out_start = outs[2 * m];
        const int64_t out_m = outs[2 * m + 1] - out_start;
        const float* bt = w + base[slot] + entry[0];
        // Expand: each row of B^T is read once and added to every token's output.
        expand_rows(yp + start * y_stride + out_start, y_stride, rows, bt, rank_m, out_m, h.data() + col, rank);
      }
    }
  };
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), num_segments);
  double total = 0;
  for (double c : cost) total += c;
  // Small calls run inline: a thread team's fork and join costs more than a few hundred thousand flops.
  if (parts <= 1 || total < 2e5) {
    work(0, num_segments);
    return;
  }
  const std::vector<int64_t> bounds = balanced_runs(cost, parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) work(bounds[p], bounds[p + 1]);
  });
}


TORCH_LIBRARY(loraplex_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor ctx_lens, "
        "Tensor tokens, float scale, int window, float softcap, Tensor(a!) out) -> ()");
  m.def("lora_add(Tensor x, Tensor(a!) y, Tensor weights, Tensor segments, Tensor bases, Tensor a_offsets, "
        "Tensor a_ranks, Tensor outputs, Tensor modules) -> ()");
  m.def("int8_linear_dynamic(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("int4_linear_dynamic(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size, Tensor? bias, "
        "Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplex_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("lora_add", &lora_add);
}
