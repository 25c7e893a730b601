// CPU kernels for the fp32 decode step besides the GGUF GEMV: paged decode attention, the
// KV-cache write and RMSNorm. Built into the same extension as gguf_gemv.cpp (it calls
// `duet::register_cpu_ops` from its PYBIND11_MODULE) with the same flags: -O3
// -march=native -ffp-contract=off -fopenmp.
//
// Why: the torch attention backend gathers every decode sequence's K/V blocks into one
// padded tensor per layer (index_select) and then runs SDPA over it, so the cache is read,
// written out and read again; here each query reads its K/V straight from the blocks, once.
// F.rms_norm on CPU runs as five or six separate aten ops (~30 us a call at one row, 61
// calls a step); one pass here is a few microseconds.
//
// The KV cache may be fp32, bf16 or fp16 (--kv-cache-dtype): the write rounds to it, the
// attention widens each key and value to fp32 as it loads it and computes as for fp32.
//
// -ffp-contract=off (needed by the GGUF dequantization) keeps the compiler from fusing
// a*b+c; where fused multiply-adds are wanted (the attention dot products and the V
// accumulation) they are written as intrinsics, which the flag does not touch. RMSNorm
// keeps torch's separately rounded operations.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#define DUET_CPU_OPS_AVX512 1
#include <immintrin.h>
#endif

namespace {

// ---------------------------------------------------------------------------------------
// Paged decode attention
// ---------------------------------------------------------------------------------------

// The cache's element type T is float, c10::BFloat16 or c10::Half (--kv-cache-dtype);
// every read widens to fp32, which is exact, so a 16-bit cache changes what is stored
// (rounded at the write) but not how attention computes over it.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

// Where one (sequence, kv head) reads: the keys of token t sit at
// k + (table[t / block_size] * block_size + t % block_size) * token_stride, values at the
// same offset from v.
template <typename T>
struct KvView {
  const T* k;
  const T* v;
  const int32_t* table;
  int64_t block_size;
  int64_t token_stride;  // elements between consecutive tokens of a block: kv_heads * head_dim
};

// Requests the rows of block `b` (`row_bytes` each, from `rows`: kv.k or kv.v).
template <typename T>
inline void prefetch_block(const KvView<T>& kv, const T* rows, int64_t b, int64_t len,
                           int64_t row_bytes) {
  const int64_t t0 = b * kv.block_size;
  if (t0 >= len) return;
  const int64_t count = std::min(kv.block_size, len - t0);
  const char* p = reinterpret_cast<const char*>(
      rows + static_cast<int64_t>(kv.table[b]) * kv.block_size * kv.token_stride);
  const int64_t token_bytes = kv.token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < count; ++o)
    for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(p + o * token_bytes + c);
}

// Blocks ahead whose rows are also requested into L2: the L1 request one block ahead
// alone leaves the core waiting on DRAM at the start of each block, as L1 can hold only a
// few misses in flight. 32 sequences x 200 tokens over 30 layers' caches, 1 thread: 1.34
// -> 1.00 ms a layer (2 threads 0.72 -> 0.60); 1, 3, 4 and 8 blocks ahead were slower.
constexpr int64_t kL2AheadBlocks = 2;

// Requests `count` rows of `row_bytes`, `token_bytes` apart, into L1 (Locality 3) or L2 (2).
template <int Locality>
inline void prefetch_rows(const char* p, int64_t count, int64_t token_bytes, int64_t row_bytes) {
  for (int64_t o = 0; o < count; ++o)
    for (int64_t c = 0; c < row_bytes; c += 64)
      __builtin_prefetch(p + o * token_bytes + c, 0, Locality);
}

// Calls fn(t, offset_of_token_t) for t in [0, len), one block at a time. Given `rows`,
// the next block's rows are requested into L1 while this one is worked on, and the one
// kL2AheadBlocks on into L2: blocks are scattered, so the hardware prefetchers cannot run
// ahead across them. Measured at 32 sequences of 150 tokens (SmolLM2's shapes, 30 layers'
// caches), the L1 request alone: 28.6 -> 21 ms.
template <typename T, typename Fn>
inline void for_each_token(const KvView<T>& kv, int64_t len, Fn&& fn, const T* rows = nullptr,
                           int64_t row_bytes = 0) {
  const int64_t block_elems = kv.block_size * kv.token_stride;
  const int64_t token_bytes = kv.token_stride * static_cast<int64_t>(sizeof(T));
  const auto block_at = [&](int64_t b) {
    return reinterpret_cast<const char*>(rows + static_cast<int64_t>(kv.table[b]) * block_elems);
  };
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += kv.block_size, ++b) {
    const int64_t base = static_cast<int64_t>(kv.table[b]) * block_elems;
    const int64_t count = std::min(kv.block_size, len - t0);
    // Inline rather than through prefetch_block: that call here measured ~30% slower.
    const int64_t next = t0 + kv.block_size, far = t0 + kL2AheadBlocks * kv.block_size;
    if (rows != nullptr && next < len)
      prefetch_rows<3>(block_at(b + 1), std::min(kv.block_size, len - next), token_bytes,
                       row_bytes);
    if (rows != nullptr && far < len)
      prefetch_rows<2>(block_at(b + kL2AheadBlocks), std::min(kv.block_size, len - far),
                       token_bytes, row_bytes);
    for (int64_t o = 0; o < count; ++o) fn(t0 + o, base + o * kv.token_stride);
  }
}

// Portable path (any head_dim, any CPU): written lane-parallel so -march=native can
// vectorize it without reassociating (there is no -ffast-math).
template <typename T>
void attend_generic(const float* q, float* out, const KvView<T>& kv, int64_t len,
                    int64_t groups, int64_t dim, float scale, float* scores, float* acc) {
  constexpr int kLanes = 16;
  for_each_token(kv, len, [&](int64_t t, int64_t off) {
    const T* kp = kv.k + off;
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = q + g * dim;
      float lanes[kLanes] = {};
      int64_t d = 0;
      for (; d + kLanes <= dim; d += kLanes)
        for (int j = 0; j < kLanes; ++j) lanes[j] += qg[d + j] * widen(kp[d + j]);
      float s = 0.f;
      for (; d < dim; ++d) s += qg[d] * widen(kp[d]);
      for (int j = 0; j < kLanes; ++j) s += lanes[j];
      scores[g * len + t] = s * scale;
    }
  });
  std::vector<float> inv(groups);
  for (int64_t g = 0; g < groups; ++g) {
    float* s = scores + g * len;
    const float m = *std::max_element(s, s + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inv[g] = 1.f / sum;
  }
  std::fill(acc, acc + groups * dim, 0.f);
  for_each_token(kv, len, [&](int64_t t, int64_t off) {
    const T* vp = kv.v + off;
    for (int64_t g = 0; g < groups; ++g) {
      const float p = scores[g * len + t];
      float* a = acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * widen(vp[d]);
    }
  });
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = acc[g * dim + d] * inv[g];
}

#ifdef DUET_CPU_OPS_AVX512

// 16 cache elements widened to fp32: fp16 by the F16C-style conversion AVX-512F has, bf16
// by placing its 16 bits at the top of each fp32 lane (bf16 is fp32's upper half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for x <= 0 (softmax after subtracting the max), cephes' expf: Cody-Waite reduction
// by ln 2 and a degree-5 polynomial, about 1 ulp. x below -87 gives ~0 (scalef underflows
// gracefully); that is where expf's result is denormal or zero anyway.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Softmax numerators in place over s[0, len), returning 1 / their sum.
inline float softmax_in_place(float* s, int64_t len) {
  const int64_t full = len & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1u);
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < full; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
  if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + full));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < full; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), m));
    _mm512_mask_storeu_ps(s + full, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// head_dim = 16 * V. G query heads share each key/value row: the keys are loaded once per
// token for all of them, and the value accumulators of all G heads stay in registers
// (G * V <= 16 of the 32 zmm registers) for the whole sequence.
template <int V, int G, typename T>
void accumulate_values(const KvView<T>& kv, int64_t len, const float* p, float* out,
                       const float* inv) {
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
  for_each_token(kv, len, [&](int64_t t, int64_t off) {
    const T* vp = kv.v + off;
    __m512 vr[V];
    for (int j = 0; j < V; ++j) vr[j] = load16(vp + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * len + t]);
      for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(pg, vr[j], acc[g][j]);
    }
  }, kv.v, 16 * V * static_cast<int64_t>(sizeof(T)));
  for (int g = 0; g < G; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    for (int j = 0; j < V; ++j)
      _mm512_storeu_ps(out + g * 16 * V + 16 * j, _mm512_mul_ps(acc[g][j], s));
  }
}

// scores[g * len + t] = q_g . k_t for G heads, their queries held in registers.
template <int V, int G, typename T>
void scores_for(const float* q, const KvView<T>& kv, int64_t len, float* scores) {
  __m512 qr[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) qr[g][j] = _mm512_loadu_ps(q + g * 16 * V + 16 * j);
  for_each_token(kv, len, [&](int64_t t, int64_t off) {
    const T* kp = kv.k + off;
    __m512 kr[V];
    for (int j = 0; j < V; ++j) kr[j] = load16(kp + 16 * j);
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_mul_ps(qr[g][0], kr[0]);
      for (int j = 1; j < V; ++j) s = _mm512_fmadd_ps(qr[g][j], kr[j], s);
      scores[g * len + t] = _mm512_reduce_add_ps(s);
    }
  }, kv.k, 16 * V * static_cast<int64_t>(sizeof(T)));
}

// Heads in chunks of up to 16 / V (so their registers fit), each chunk one pass over the
// sequence's rows; q arrives pre-scaled.
template <int V, typename T>
void attend_vec(const float* q, float* out, const KvView<T>& kv, int64_t len, int64_t groups,
                float* scores, float* inv) {
  constexpr int kChunk = std::max(1, 16 / V);
  constexpr int64_t dim = 16 * V;
  constexpr int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  // The value pass starts on a block nothing has requested yet; ask for it now, so it
  // arrives during the key pass (~8% at 32 x 150 tokens).
  prefetch_block(kv, kv.v, 0, len, row_bytes);
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, groups - g0);
    float* s = scores + g0 * len;
    // The switch turns the runtime head count into the template argument that lets the
    // accumulators live in registers. kChunk is at most 4 for V >= 4.
    switch (n) {
#define DUET_SCORES_CASE(N) \
  case N:                   \
    if constexpr (N <= kChunk) scores_for<V, N>(q + g0 * dim, kv, len, s); \
    break;
      DUET_SCORES_CASE(1)
      DUET_SCORES_CASE(2)
      DUET_SCORES_CASE(3)
      DUET_SCORES_CASE(4)
#undef DUET_SCORES_CASE
    }
  }
  for (int64_t g = 0; g < groups; ++g) inv[g] = softmax_in_place(scores + g * len, len);
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, groups - g0);
    const float* p = scores + g0 * len;
    switch (n) {
#define DUET_VALUES_CASE(N) \
  case N:                   \
    if constexpr (N <= kChunk) accumulate_values<V, N>(kv, len, p, out + g0 * dim, inv + g0); \
    break;
      DUET_VALUES_CASE(1)
      DUET_VALUES_CASE(2)
      DUET_VALUES_CASE(3)
      DUET_VALUES_CASE(4)
#undef DUET_VALUES_CASE
    }
  }
}

#endif  // DUET_CPU_OPS_AVX512

// `run(pointer)` on the cache's data, typed by its dtype (fp32, bf16 or fp16; checked by
// the callers).
template <typename Run>
void with_cache_data(const torch::Tensor& kv_cache, Run&& run) {
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16:
      run(kv_cache.data_ptr<c10::BFloat16>());
      break;
    case at::kHalf:
      run(kv_cache.data_ptr<c10::Half>());
      break;
    default:
      run(kv_cache.data_ptr<float>());
  }
}

constexpr int64_t kAttentionChunkRows = 4096;

// One decode batch over a cache of T: queries' rows, each (sequence, kv head) one item.
template <typename T>
void decode_batch(const float* q_data, int64_t q_row, const T* k_data, const T* v_data,
                  const int32_t* tables, int64_t width, const int32_t* lens, int64_t n,
                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                  int64_t total, int64_t longest, float scale, bool use_vec, float* out_data) {
  const int64_t groups = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;
  // Work item = (sequence, kv head). A chunk of ~4k key rows is ~0.2 ms of work, well above
  // a thread pool's wake-up; fewer rows in all stay one chunk.
  const int64_t items = n * kv_heads;
  const int64_t rows = std::max<int64_t>(1, total * kv_heads);
  const int64_t grain = std::max<int64_t>(1, items * kAttentionChunkRows / rows);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(groups * std::max<int64_t>(longest, 1));
    std::vector<float> qs(groups * dim), acc(groups * dim), inv(groups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[i];
      float* o = out_data + (i * heads + h * groups) * dim;
      if (len == 0) {
        std::fill(o, o + groups * dim, 0.f);
        continue;
      }
      // Scaling q once costs groups * dim multiplies instead of len * groups.
      const float* qi = q_data + i * q_row + h * groups * dim;
      for (int64_t d = 0; d < groups * dim; ++d) qs[d] = qi[d] * scale;
      const KvView<T> kv{k_data + h * dim, v_data + h * dim, tables + i * width, block_size,
                         token_stride};
#ifdef DUET_CPU_OPS_AVX512
      if (use_vec) {
        if (dim == 64)
          attend_vec<4>(qs.data(), o, kv, len, groups, scores.data(), inv.data());
        else
          attend_vec<8>(qs.data(), o, kv, len, groups, scores.data(), inv.data());
        continue;
      }
#endif
      attend_generic(qs.data(), o, kv, len, groups, dim, 1.f, scores.data(), acc.data());
    }
  });
}

bool is_kv_cache_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale, bool vector) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && is_kv_cache_dtype(kv_cache.scalar_type()),
              "paged_decode_attention: q must be float32 and kv_cache float32, bfloat16 or "
              "float16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and seq_lens must be int32");
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [n, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "paged_decode_attention: kv_cache must be [2, blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(kv_cache.is_contiguous(), "paged_decode_attention: kv_cache must be contiguous");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == dim, "paged_decode_attention: head_dim of q (", dim,
              ") and kv_cache (", kv_cache.size(4), ") differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode_attention: ", heads,
              " query heads are not a multiple of ", kv_heads, " kv heads");
  // Rows may be strided (q is a view of the fused qkv projection); each row's heads not.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == dim,
              "paged_decode_attention: each row of q must be contiguous [heads, head_dim]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n &&
                  block_tables.is_contiguous(),
              "paged_decode_attention: block_tables must be contiguous [n, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == n && seq_lens.is_contiguous(),
              "paged_decode_attention: seq_lens must be contiguous [n]");

  const int64_t width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t total = 0, longest = 0;
  // Every block a query will read must exist: checked here, not inside the parallel loop.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = lens[i];
    TORCH_CHECK(len >= 0 && len <= width * block_size, "paged_decode_attention: seq_lens[",
                i, "] = ", len, " does not fit ", width, " blocks of ", block_size);
    for (int64_t b = 0; b * block_size < len; ++b) {
      const int32_t id = tables[i * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: block_tables[", i,
                  ", ", b, "] = ", id, " is not a block of the cache (", num_blocks, ")");
    }
    total += len;
    longest = std::max(longest, len);
  }

  auto out = torch::empty({n, heads, dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  bool use_vec = false;
#ifdef DUET_CPU_OPS_AVX512
  use_vec = vector && (dim == 64 || dim == 128);
#endif
  const auto run = [&](auto* k_data) {
    decode_batch(q.data_ptr<float>(), q.stride(0), k_data, k_data + kv_cache.stride(0), tables,
                 width, lens, n, heads, kv_heads, dim, block_size, total, longest,
                 static_cast<float>(scale), use_vec, out.data_ptr<float>());
  };
  with_cache_data(kv_cache, run);
  return out;
}

// ---------------------------------------------------------------------------------------
// KV-cache write
// ---------------------------------------------------------------------------------------

// One fp32 row into the cache's element type: a copy for fp32, else c10's rounding to
// nearest even, the conversion torch's `.to()` makes.
inline void store_row(float* dst, const float* src, int64_t count) {
  std::memcpy(dst, src, count * sizeof(float));
}
template <typename T>
inline void store_row(T* dst, const float* src, int64_t count) {
  for (int64_t e = 0; e < count; ++e) dst[e] = static_cast<T>(src[e]);
}

template <typename T>
void write_rows(const float* kd, int64_t k_stride, const float* vd, int64_t v_stride, T* kc,
                T* vc, const int64_t* slot, int64_t tokens, int64_t row) {
  for (int64_t t = 0; t < tokens; ++t) {
    store_row(kc + slot[t] * row, kd + t * k_stride, row);
    store_row(vc + slot[t] * row, vd + t * v_stride, row);
  }
}

// kv_cache[0/1] viewed as [slots, kv_heads, head_dim]: row slot_mapping[t] <- k[t] / v[t].
// One call for both tensors and a memcpy (or conversion) per row, instead of two
// index_copy_ calls.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kv_cache,
              const torch::Tensor& slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "write_kv: CPU tensors only");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  is_kv_cache_dtype(kv_cache.scalar_type()),
              "write_kv: k and v must be float32 and kv_cache float32, bfloat16 or float16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(),
              "write_kv: slot_mapping must be contiguous int64 [tokens]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv: kv_cache must be contiguous [2, blocks, block_size, kv_heads, dim]");
  const int64_t tokens = slot_mapping.size(0);
  const int64_t kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == kv_heads &&
                    t->size(2) == dim,
                "write_kv: k and v must be [tokens, kv_heads, head_dim] matching the cache");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == dim,
                "write_kv: each row of k and v must be contiguous [kv_heads, head_dim]");
  }
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "write_kv: slot_mapping[", t, "] = ", slot[t],
                " is outside the cache's ", slots, " slots");
  const int64_t row = kv_heads * dim;
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const auto run = [&](auto* kc) {
    write_rows(kd, k.stride(0), vd, v.stride(0), kc, kc + kv_cache.stride(0), slot, tokens, row);
  };
  with_cache_data(kv_cache, run);
}

// ---------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------

// sum(x^2) over a row in double: fp32 products are exact in double, so the sum is about
// exact, and torch's fp32 mean differs from it only by its own rounding.
inline double sum_squares(const float* x, int64_t n) {
  int64_t d = 0;
  double s = 0.0;
#ifdef DUET_CPU_OPS_AVX512
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (; d + 16 <= n; d += 16) {
    const __m512d x0 = _mm512_cvtps_pd(_mm256_loadu_ps(x + d));
    const __m512d x1 = _mm512_cvtps_pd(_mm256_loadu_ps(x + d + 8));
    a0 = _mm512_fmadd_pd(x0, x0, a0);
    a1 = _mm512_fmadd_pd(x1, x1, a1);
  }
  s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
  for (; d < n; ++d) s += static_cast<double>(x[d]) * x[d];
  return s;
}

// out = (x * rsqrt(mean(x^2) + eps)) * weight, each operation rounded to fp32 as torch's
// decomposition does (mean, + eps, rsqrt as 1 / sqrt, then the two products).
inline void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float mean = static_cast<float>(sum_squares(x, n) / static_cast<double>(n));
  const float r = 1.f / std::sqrt(mean + eps);
  for (int64_t d = 0; d < n; ++d) out[d] = (x[d] * r) * w[d];
}

void check_norm_args(const torch::Tensor& x, const torch::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, name,
              ": x and weight must be float32");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), name, ": x must be contiguous [..., hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1), name,
              ": weight must be contiguous [hidden] matching x's last dimension");
}

// Rows per parallel chunk: a row is ~1 us at hidden 576, so small batches stay inline.
constexpr int64_t kNormGrain = 64;

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_norm_args(x, weight, "rms_norm");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  const float* xd = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, kNormGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xd + r * hidden, w, o + r * hidden, hidden, feps);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_norm_args(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.device().is_cpu() && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous() && residual.sizes() == x.sizes(),
              "add_rms_norm: residual must be contiguous float32 shaped like x");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  auto sum = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  const float* xd = x.data_ptr<float>();
  const float* rd = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, kNormGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * hidden;
      // residual + x, one fp32 rounding, as torch's add.
      for (int64_t d = 0; d < hidden; ++d) s[base + d] = rd[base + d] + xd[base + d];
      rms_row(s + base, w, o + base, hidden, feps);
    }
  });
  return {out, sum};
}

// Rotary embedding of q and k heads side by side: out = x * cos + roll(x, D/2) * sin per
// head, each product and the sum rounded to fp32 (the build keeps them unfused), so the
// values are torch's `apply_rotary` ones bit for bit. One pass instead of torch's five ops
// and three temporaries; a decode step's few rows stay on one thread.
constexpr int64_t kRotaryGrain = 1 << 15;  // elements per parallel chunk

torch::Tensor rotate_qk(const torch::Tensor& qk, const torch::Tensor& cos,
                        const torch::Tensor& sin) {
  TORCH_CHECK(qk.device().is_cpu() && qk.scalar_type() == at::kFloat && qk.dim() == 3,
              "rotate_qk: qk must be CPU float32 [tokens, heads, head_dim]");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  TORCH_CHECK(dim % 2 == 0 && qk.stride(2) == 1 && qk.stride(1) == dim,
              "rotate_qk: each token's heads must be contiguous, of an even head_dim");
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() &&
                    table->numel() == tokens * dim,
                "rotate_qk: cos and sin must be contiguous float32 [tokens, 1, head_dim]");
  auto out = torch::empty({tokens, heads, dim}, qk.options());
  const int64_t half = dim / 2, row = heads * dim, token_stride = qk.stride(0);
  const float* x = qk.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kRotaryGrain / std::max<int64_t>(1, row));
  at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* ct = c + t * dim;
      const float* st = s + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = x + t * token_stride + h * dim;
        float* oh = o + t * row + h * dim;
        for (int64_t d = 0; d < half; ++d) {
          const float a = xh[d] * ct[d];
          const float b = xh[d + half] * st[d];
          oh[d] = a + b;
        }
        for (int64_t d = half; d < dim; ++d) {
          const float a = xh[d] * ct[d];
          const float b = xh[d - half] * st[d];
          oh[d] = a + b;
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace duet {

void register_cpu_ops(pybind11::module_& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence over its K/V in the paged cache", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("vector") = true);
  m.def("write_kv", &write_kv, "store k/v rows into their cache slots", py::arg("k"),
        py::arg("v"), py::arg("kv_cache"), py::arg("slot_mapping"));
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension", py::arg("x"),
        py::arg("weight"), py::arg("eps"));
  m.def("rotate_qk", &rotate_qk, "rotary embedding of [tokens, heads, head_dim]", py::arg("qk"),
        py::arg("cos"), py::arg("sin"));
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
}

}  // namespace duet
