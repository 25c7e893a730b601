// y[M, N] = x[M, K] @ W^T for W stored as GGUF blocks, fp32 in and out. Types: Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and the K-quants Q4_K, Q5_K, Q6_K (superblocks of
// 256, each 8 sub-blocks of 32 with 6- or 8-bit scales of their own).
//
// Decode on CPU is bound by streaming the weights, and these formats are 4.5-8.5 bits per
// weight instead of fp32's 32. Each weight is dequantized exactly as gguf's numpy
// `dequantize` does it (fp32 ops, rounded after each one: built with -ffp-contract=off so
// that d*q + m never becomes one fused multiply-add), then multiplied into fp32
// accumulators, so the result differs from `x @ dequantized.T` only in summation order.
//
// Layout (made by gguf_linear.QuantizedWeight.from_gguf): one row per output feature, a
// header of the row's scales first, then its "units" of 32 weights, a fixed number of
// quant bytes each. A tile's headers are turned into fp32 parameters per unit (`prepare`)
// once, into a small buffer that the inner loops broadcast from; converting and
// broadcasting each block's scale in the inner loop made it 1.5-2x slower at one row.
//   type  header (per group of units)              params per unit     quant bytes per unit
//   Q4_0  d (fp16), per unit                       d                   16 nibbles
//   Q4_1  d m (fp16), per unit                     d, m                16 nibbles
//   Q5_0  d (fp16), per unit                       d                   4 plane + 16 nibbles
//   Q5_1  d m (fp16), per unit                     d, m                4 plane + 16 nibbles
//   Q8_0  d (fp16), per unit                       d                   32 int8
//   Q4_K  d dmin (fp16) sc0 m0 .. sc7 m7 (u8),     d*sc, dmin*m        16 nibbles
//         per 8 units (20 bytes)
//   Q5_K  as Q4_K                                  d*sc, dmin*m        4 plane + 16 nibbles
//   Q6_K  d (fp16) sc0 .. sc15 (int8), per 8       d*sc[2u], d*sc[2u+1] 8 planes + 16 nibbles
//         units (18 bytes)                         (elements 0-15, 16-31)
// Nibble byte i holds element i (low) and element 16 + i (high); a plane is a little-endian
// uint32 whose bit i is one more bit (the 5th, then the 6th) of element i. The Q4_0/Q4_1/
// Q8_0/Q5_0/Q5_1 rows are the file's bytes with the scales moved to the front; the K-quant
// rows are repacked (6-bit scales unpacked to bytes, quants into units), within 3% of the
// file's bytes (148/180/210 per 256 weights against 144/176/210).

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DUET_AVX512 1
#include <immintrin.h>
#endif

namespace {

// ggml's type ids, as gguf.GGMLQuantizationType numbers them.
constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ5_0 = 6;
constexpr int kQ5_1 = 7;
constexpr int kQ8_0 = 8;
constexpr int kQ4_K = 12;
constexpr int kQ5_K = 13;
constexpr int kQ6_K = 14;
constexpr int kBlock = 32;  // weights per unit
// Rows per task unit: their blocks stay in L1 while every 8-row slice of x passes over them.
constexpr int64_t kTileRows = 16;
#ifndef DUET_PREFETCH_BYTES
#define DUET_PREFETCH_BYTES 16384
#endif
constexpr int64_t kPrefetchBytes = DUET_PREFETCH_BYTES;

// Tiles per parallel task: enough that a task reads ~256 KiB of weights or does ~1M
// multiply-adds, whichever comes first. Below both, the fork/join costs more than a second
// thread saves; a batch of rows makes even a small weight worth splitting (an o projection
// of 576 x 576 at 32 rows is 10M multiply-adds, which ran on one thread under the bytes
// rule alone). Each output is still computed by one task, so the values do not change.
int64_t task_grain(int64_t tile_bytes, int64_t tile_macs) {
  const int64_t by_bytes = (256 << 10) / std::max<int64_t>(1, tile_bytes);
  const int64_t by_macs = (1 << 20) / std::max<int64_t>(1, tile_macs);
  return std::max<int64_t>(1, std::min(by_bytes, by_macs));
}

template <int QT>
struct Format {
  static constexpr bool k_quant = QT == kQ4_K || QT == kQ5_K || QT == kQ6_K;
  // Units sharing one header group, and that group's header bytes.
  static constexpr int group_units = k_quant ? 8 : 1;
  static constexpr int group_bytes = QT == kQ6_K                  ? 18
                                     : k_quant                    ? 20
                                     : QT == kQ4_1 || QT == kQ5_1 ? 4
                                                                  : 2;
  // fp32 values per unit after `prepare`.
  static constexpr int params = QT == kQ4_0 || QT == kQ5_0 || QT == kQ8_0 ? 1 : 2;
  // uint32 bit planes above the nibbles: the 5th bit, and for Q6_K the 6th.
  static constexpr int planes = QT == kQ6_K ? 2 : (QT == kQ5_0 || QT == kQ5_1 || QT == kQ5_K);
  static constexpr int quant_bytes = QT == kQ8_0 ? 32 : 4 * planes + 16;
  // Header bytes of a row of `units` units.
  static constexpr int64_t header_bytes(int64_t units) {
    return units / group_units * group_bytes;
  }
  static constexpr int64_t row_bytes(int64_t units) {
    return header_bytes(units) + units * quant_bytes;
  }
};

// Calls fn(std::integral_constant<int, QT>{}) for the type id `qtype`.
template <typename Fn>
void with_format(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case kQ4_0:
      return fn(std::integral_constant<int, kQ4_0>{});
    case kQ4_1:
      return fn(std::integral_constant<int, kQ4_1>{});
    case kQ5_0:
      return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1:
      return fn(std::integral_constant<int, kQ5_1>{});
    case kQ8_0:
      return fn(std::integral_constant<int, kQ8_0>{});
    case kQ4_K:
      return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_K:
      return fn(std::integral_constant<int, kQ5_K>{});
    case kQ6_K:
      return fn(std::integral_constant<int, kQ6_K>{});
    default:
      TORCH_CHECK(false, "gguf_gemv: unsupported GGML type ", qtype);
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The fp16 scales at the front of `rows` rows (row_bytes apart) as fp32, `count` per row,
// into out[rows][count]. fp16 -> fp32 is exact, whichever instruction does it.
void convert_scales(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t count,
                    float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * row_bytes;
    float* dst = out + r * count;
    int64_t i = 0;
#ifdef DUET_AVX512
    for (; i + 16 <= count; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i));
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
    }
#endif
    for (; i < count; ++i) dst[i] = half_at(src + 2 * i);
  }
}

// The fp32 parameters of `units` units of each of `rows` rows (headers row_bytes apart)
// into out[rows][units][params]. A K-quant group's 16 parameters are one product each, as
// gguf rounds them: d * sc and dmin * m (Q4_K, Q5_K), d * sc (Q6_K).
template <int QT>
void prepare(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t units, float* out) {
  using F = Format<QT>;
  if constexpr (!F::k_quant) {
    convert_scales(w, row_bytes, rows, units * F::params, out);
  } else {
    static_assert(F::group_units * F::params == 16);
    const int64_t groups = units / F::group_units;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* h = w + r * row_bytes + g * F::group_bytes;
        float* dst = out + (r * groups + g) * 16;
        const float d = half_at(h);
        // Q4_K/Q5_K interleave (sc, m) pairs, multiplied by (d, dmin); Q6_K has 16 scales.
        const float odd = QT == kQ6_K ? d : half_at(h + 2);
        const uint8_t* sc = h + (QT == kQ6_K ? 2 : 4);
#ifdef DUET_AVX512
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
        const __m512i ints =
            QT == kQ6_K ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
        const __m512 mult = _mm512_mask_blend_ps(0xAAAA, _mm512_set1_ps(d), _mm512_set1_ps(odd));
        _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_cvtepi32_ps(ints), mult));
#else
        for (int i = 0; i < 16; ++i) {
          const float s = QT == kQ6_K ? static_cast<float>(static_cast<int8_t>(sc[i]))
                                      : static_cast<float>(sc[i]);
          dst[i] = s * (i % 2 ? odd : d);
        }
#endif
      }
    }
  }
}

// The integer quant of element i (0..31) of a unit: its nibble and its plane bits.
template <int QT>
inline int quant_at(const uint8_t* q, int i) {
  constexpr int planes = Format<QT>::planes;
  const uint8_t* nibbles = q + 4 * planes;
  int v = i < 16 ? nibbles[i] & 0x0F : nibbles[i - 16] >> 4;
  for (int p = 0; p < planes; ++p) v |= static_cast<int>((u32_at(q + 4 * p) >> i) & 1) << (4 + p);
  return v;
}

// ---- scalar path: the build for CPUs without AVX-512, and a cross-check for the vector one.

// One unit's 32 weights from its parameters `p` and quant bytes `q`, in gguf's fp32 steps.
template <int QT>
inline void dequant_block_scalar(const float* p, const uint8_t* q, float* w) {
  const float d = p[0];
  if constexpr (QT == kQ8_0) {
    for (int i = 0; i < kBlock; ++i) w[i] = static_cast<float>(static_cast<int8_t>(q[i])) * d;
  } else {
    for (int i = 0; i < kBlock; ++i) {
      const int v = quant_at<QT>(q, i);
      if constexpr (QT == kQ4_0) {
        w[i] = d * static_cast<float>(v - 8);
      } else if constexpr (QT == kQ5_0) {
        w[i] = d * static_cast<float>(v - 16);
      } else if constexpr (QT == kQ4_1 || QT == kQ5_1) {
        // gguf: (d * q) + m, two roundings.
        const float dq = d * static_cast<float>(v);
        w[i] = dq + p[1];
      } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
        // gguf: (d*sc) * q - (dmin*m), the products already rounded by `prepare`.
        const float dq = d * static_cast<float>(v);
        w[i] = dq - p[1];
      } else {
        static_assert(QT == kQ6_K);
        w[i] = p[i / 16] * static_cast<float>(v - 32);
      }
    }
  }
}

// Output features [n0, n1) for x rows [0, mc), mc <= 8; `sc` holds the rows' fp32
// parameters. The 16 lanes are independent, so the compiler vectorizes without
// reassociating anything.
template <int QT>
void rows_scalar(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                 const float* sc, int64_t n0, int64_t n1, int64_t mc, float* y, int64_t N,
                 const float* bias) {
  using F = Format<QT>;
  const int64_t nb = K / kBlock;
  float wb[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[8][16] = {};
    const uint8_t* q = w + n * row_bytes + F::header_bytes(nb);
    const float* s = sc + (n - n0) * nb * F::params;
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block_scalar<QT>(s + b * F::params, q + b * F::quant_bytes, wb);
      for (int64_t m = 0; m < mc; ++m) {
        const float* xb = x + m * K + b * kBlock;
        for (int i = 0; i < 16; ++i) acc[m][i] += wb[i] * xb[i];
        for (int i = 0; i < 16; ++i) acc[m][i] += wb[16 + i] * xb[16 + i];
      }
    }
    for (int64_t m = 0; m < mc; ++m) {
      float total = 0.0f;
      for (int i = 0; i < 16; ++i) total += acc[m][i];
      y[m * N + n] = total + (bias ? bias[n] : 0.0f);
    }
  }
}

#ifdef DUET_AVX512

// A 5- or 6-bit unit's 32 quants as bytes (element i in byte i): the nibbles split with
// 128-bit byte ops, each plane added in by one byte-masked add over all 32 elements.
// Building them at byte width, then widening, takes about half the 512-bit operations of
// widening first and masking 16 lanes at a time.
template <int QT>
inline __m256i unit_quants(const uint8_t* q) {
  constexpr int planes = Format<QT>::planes;
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4 * planes));
  const __m128i low_bits = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, low_bits);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low_bits);
  __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(u32_at(q)), v, _mm256_set1_epi8(16));
  if constexpr (planes == 2)
    v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(u32_at(q + 4)), v, _mm256_set1_epi8(32));
  return v;
}

// One unit as two vectors: elements 0..15 and 16..31.
template <int QT>
inline void dequant_block_avx512(const float* p, const uint8_t* q, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(p[0]);
  if constexpr (QT == kQ8_0) {
    const __m512i lo8 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i hi8 =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo8), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(hi8), d);
  } else if constexpr (QT == kQ6_K) {
    // 64 values and two scales: arithmetic beats four lookup tables. q - 32 as 32 int8
    // (`unit_quants`), then widened to fp32 16 at a time and scaled.
    const __m256i q8 = _mm256_sub_epi8(unit_quants<QT>(q), _mm256_set1_epi8(32));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q8))));
    hi = _mm512_mul_ps(_mm512_set1_ps(p[1]),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q8, 1))));
  } else {
    // A 4-bit unit has only 16 distinct values, a 5-bit one 32: compute them once, in
    // gguf's exact fp32 steps, and look each quant up with a lane permute (which reads
    // only the index's low 4 bits, so the low nibble needs no mask; a 5-bit quant picks
    // from two tables by its 5th index bit).
    constexpr bool five_bits = Format<QT>::planes == 1;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    auto table = [&](__m512 values) {
      if constexpr (QT == kQ4_1 || QT == kQ5_1) {
        return _mm512_add_ps(_mm512_mul_ps(d, values), _mm512_set1_ps(p[1]));
      } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
        return _mm512_sub_ps(_mm512_mul_ps(d, values), _mm512_set1_ps(p[1]));
      } else {  // Q4_0, Q5_0: d * (q - 8), d * (q - 16)
        return _mm512_mul_ps(d, _mm512_sub_ps(values, _mm512_set1_ps(five_bits ? 16.0f : 8.0f)));
      }
    };
    const __m512 lower = table(iota);
    if constexpr (five_bits) {
      const __m512 upper = table(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)));
      const __m256i q8 = unit_quants<QT>(q);
      lo = _mm512_permutex2var_ps(lower, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q8)), upper);
      hi = _mm512_permutex2var_ps(lower, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(q8, 1)),
                                  upper);
    } else {
      const __m512i bytes =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      lo = _mm512_permutexvar_ps(bytes, lower);
      hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lower);
    }
  }
}

// NR output features from n against MC rows of x: NR * MC accumulators, each block
// dequantized once into registers and multiplied into every x row.
template <int QT, int NR, int MC>
inline void tile_avx512(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                        const float* sc, int64_t n, float* y, int64_t N, const float* bias) {
  using F = Format<QT>;
  const int64_t nb = K / kBlock;
  __m512 acc[NR][MC];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm512_setzero_ps();
  const uint8_t* q = w + n * row_bytes + F::header_bytes(nb);
  // The rows are read in address order, but as NR short interleaved streams that the
  // hardware prefetcher picks up late; fetching kPrefetchBytes ahead overlaps the memory
  // latency with the arithmetic (1.3-1.5x on weights from DRAM).
  const uint8_t* ahead = w + n * row_bytes + kPrefetchBytes;
  const int64_t ahead_step = NR * row_bytes / nb;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(ahead + b * ahead_step), _MM_HINT_T0);
    if (ahead_step > 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * ahead_step + 64), _MM_HINT_T0);
    for (int r = 0; r < NR; ++r) {
      __m512 lo, hi;
      dequant_block_avx512<QT>(sc + (r * nb + b) * F::params,
                               q + r * row_bytes + b * F::quant_bytes, lo, hi);
      for (int m = 0; m < MC; ++m) {
        acc[r][m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + m * K), acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + m * K + 16), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MC; ++m)
      y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n + r] : 0.0f);
}

template <int QT, int MC>
void rows_avx512_mc(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                    const float* sc, int64_t n0, int64_t n1, float* y, int64_t N,
                    const float* bias) {
  // Enough independent accumulators to hide FMA latency, few enough to stay in registers.
  constexpr int NR = MC <= 4 ? 4 : 2;
  const int64_t stride = K / kBlock * Format<QT>::params;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR)
    tile_avx512<QT, NR, MC>(x, K, w, row_bytes, sc + (n - n0) * stride, n, y, N, bias);
  for (; n < n1; ++n)
    tile_avx512<QT, 1, MC>(x, K, w, row_bytes, sc + (n - n0) * stride, n, y, N, bias);
}

template <int QT>
void rows_avx512(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                 const float* sc, int64_t n0, int64_t n1, int64_t mc, float* y, int64_t N,
                 const float* bias) {
  switch (mc) {
    case 1:
      return rows_avx512_mc<QT, 1>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
    case 2:
      return rows_avx512_mc<QT, 2>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
    case 3:
      return rows_avx512_mc<QT, 3>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
    case 4:
      return rows_avx512_mc<QT, 4>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
    case 5:
      return rows_avx512_mc<QT, 5>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
    case 6:
      return rows_avx512_mc<QT, 6>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
    case 7:
      return rows_avx512_mc<QT, 7>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
    default:
      return rows_avx512_mc<QT, 8>(x, K, w, row_bytes, sc, n0, n1, y, N, bias);
  }
}

// ---- many rows: outer products over blocks dequantized once per 16 or 32 rows of x.
//
// The dot-product tiles above pass over W once per 8 rows of x, dequantizing every weight
// again each time, loading one x vector per FMA and reducing every accumulator across its
// lanes at the end. Past kDotRows rows, x is transposed to [K][M padded to 16] and the loop
// becomes a BLAS-style micro-kernel: NR weight rows x 16V rows of x in registers, each
// weight broadcast and multiplied into 16 x rows per FMA. A block of each of the NR rows is
// dequantized into a 1.5 KiB buffer that stays in L1 (a whole tile of dequantized rows
// lives in L2 and writing it cost as much as the FMAs); the 32 k-steps that follow read it.
// Each output is still one fp32 FMA chain over k, as in the dot-product path.
// The most rows the dot-product path takes. Its passes over a tile cost about one 8-row
// pass each, and the outer path's 16-row micro-kernel costs the same from 9 to 16 rows, so
// up to 12 rows two dot passes win: SmolLM2's 120 projections at 9 rows 44 -> 29 ms at one
// thread, at 12 rows 45 -> 35 ms; at 13 the outer path is ahead again.
constexpr int64_t kDotRows = 12;
// Rows past a multiple of 16 that the dot path takes in a batch the outer path runs: a
// group of 16 costs ~1.75x an 8-row dot pass, so up to 8 left-over rows are cheaper there
// (SmolLM2's 120 projections at 17 rows 70 -> 46 ms, 24 rows 71 -> 63 ms, one thread).
constexpr int64_t kDotTailRows = 8;
constexpr int64_t kOuterRows = 48;  // weight rows per task unit: 2 x 24 or 4 x 12

// Outputs n .. n+NR-1 for x rows m0 .. m0+16V-1 (those below M are stored). `q` is row
// n's first quant byte (rows row_bytes apart), `sc` the NR rows' fp32 parameters, nb units apart.
template <int QT, int NR, int V>
inline void outer_tile(const uint8_t* q, int64_t row_bytes, const float* sc, int64_t nb,
                       const float* xt, int64_t mp, int64_t m0, int64_t M, int64_t n,
                       float* y, int64_t N, const float* bias) {
  using F = Format<QT>;
  __m512 acc[NR][V];
#pragma GCC unroll 24
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  alignas(64) float wb[NR][kBlock];
  // The next NR rows' bytes (contiguous: rows are adjacent), fetched a slice per block so
  // they arrive while this tile computes (a prefetch past the last row does not fault).
  const uint8_t* ahead = q - F::header_bytes(nb) + NR * row_bytes;
  const int64_t ahead_step = NR * row_bytes / nb;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t line = 0; line < ahead_step; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * ahead_step + line), _MM_HINT_T0);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* qr = q + r * row_bytes;
      __m512 lo, hi;
      dequant_block_avx512<QT>(sc + (r * nb + b) * F::params, qr + b * F::quant_bytes, lo, hi);
      _mm512_store_ps(wb[r], lo);
      _mm512_store_ps(wb[r] + 16, hi);
    }
    const float* xk = xt + b * kBlock * mp + m0;
    // Fully unrolled, or the accumulators live in memory instead of registers.
    for (int kk = 0; kk < kBlock; ++kk, xk += mp) {
      __m512 xv[V];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xk + 16 * v);
#pragma GCC unroll 24
      for (int r = 0; r < NR; ++r) {
        const __m512 wv = _mm512_set1_ps(wb[r][kk]);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(wv, xv[v], acc[r][v]);
      }
    }
  }
  // Transposed through L1 so that each row of y gets its NR outputs in one contiguous
  // write: storing them column by column hit the rows N floats apart NR times each, and
  // when N * 4 is a multiple of 4 KiB (gate_up, the LM head) those rows all share one L1
  // set and evict each other.
  alignas(64) float lanes[16];
  float out[16 * V][NR];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) {
      _mm512_store_ps(lanes, acc[r][v]);
      for (int i = 0; i < 16; ++i) out[16 * v + i][r] = lanes[i];
    }
  const int64_t count = std::min<int64_t>(16 * V, M - m0);
  for (int64_t i = 0; i < count; ++i) {
    float* row = y + (m0 + i) * N + n;
    for (int r = 0; r < NR; ++r) row[r] = out[i][r] + (bias ? bias[n + r] : 0.0f);
  }
}

// Weight rows [n0, n0 + rows) against x rows m0 .. m0+16V-1.
template <int QT, int V>
void rows_outer(const uint8_t* w, int64_t row_bytes, const float* sc, int64_t nb, int64_t n0,
                int64_t rows, const float* xt, int64_t mp, int64_t m0, int64_t M, float* y,
                int64_t N, const float* bias) {
  using F = Format<QT>;
  // NR x V = 24 accumulators of the 32 registers; the rest hold x, the broadcast weight
  // and the dequantization.
  constexpr int NR = V == 2 ? 12 : 24;
  const uint8_t* q = w + n0 * row_bytes + F::header_bytes(nb);
  const int64_t stride = nb * F::params;
  int64_t r = 0;
  for (; r + NR <= rows; r += NR)
    outer_tile<QT, NR, V>(q + r * row_bytes, row_bytes, sc + r * stride, nb, xt, mp, m0, M,
                          n0 + r, y, N, bias);
  for (; r + 4 <= rows; r += 4)
    outer_tile<QT, 4, V>(q + r * row_bytes, row_bytes, sc + r * stride, nb, xt, mp, m0, M,
                         n0 + r, y, N, bias);
  for (; r < rows; ++r)
    outer_tile<QT, 1, V>(q + r * row_bytes, row_bytes, sc + r * stride, nb, xt, mp, m0, M,
                         n0 + r, y, N, bias);
}

template <int QT>
void gemm_outer(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                int64_t N, float* y, const float* bias) {
  const int64_t nb = K / kBlock;
  const int64_t per_row = nb * Format<QT>::params;
  const int64_t mp = (M + 15) / 16 * 16;
  std::vector<float> xt(K * mp, 0.0f);
  // k outer: the writes run along xt's rows; the M reads are M short streams.
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < M; ++m) xt[k * mp + m] = x[m * K + k];
  const int64_t tiles = (N + kOuterRows - 1) / kOuterRows;
  const int64_t grain = task_grain(kOuterRows * row_bytes, kOuterRows * K * M);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scales(kOuterRows * per_row);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kOuterRows;
      const int64_t rows = std::min(kOuterRows, N - n0);
      prepare<QT>(w + n0 * row_bytes, row_bytes, rows, nb, scales.data());
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        if (M - m0 > 16) {
          rows_outer<QT, 2>(w, row_bytes, scales.data(), nb, n0, rows, xt.data(), mp, m0, M,
                            y, N, bias);
        } else {
          rows_outer<QT, 1>(w, row_bytes, scales.data(), nb, n0, rows, xt.data(), mp, m0, M,
                            y, N, bias);
        }
      }
    }
  });
}

#endif  // DUET_AVX512

template <int QT>
void gemm_typed(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                int64_t N, float* y, const float* bias, bool vector) {
#ifdef DUET_AVX512
  if (vector && M > kDotRows) {
    // The outer path works in groups of 16 rows of x; a few rows past the last whole group
    // would pay for a group of their own, so the dot path takes them.
    const int64_t tail = M % 16 <= kDotTailRows ? M % 16 : 0;
    gemm_outer<QT>(x, M - tail, K, w, row_bytes, N, y, bias);
    if (tail == 0) return;
    x += (M - tail) * K;
    y += (M - tail) * N;
    M = tail;
  }
#endif
  const int64_t per_row = K / kBlock * Format<QT>::params;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t grain = task_grain(kTileRows * row_bytes, kTileRows * K * M);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scales(kTileRows * per_row);
    const int64_t n_end = std::min(N, t1 * kTileRows);
    for (int64_t n0 = t0 * kTileRows; n0 < n_end; n0 += kTileRows) {
      const int64_t n1 = std::min(n_end, n0 + kTileRows);
      prepare<QT>(w + n0 * row_bytes, row_bytes, n1 - n0, K / kBlock, scales.data());
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mc = std::min<int64_t>(8, M - m0);
#ifdef DUET_AVX512
        if (vector) {
          rows_avx512<QT>(x + m0 * K, K, w, row_bytes, scales.data(), n0, n1, mc, y + m0 * N,
                          N, bias);
          continue;
        }
#endif
        rows_scalar<QT>(x + m0 * K, K, w, row_bytes, scales.data(), n0, n1, mc, y + m0 * N, N,
                        bias);
      }
    }
  });
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
                  w.is_contiguous(),
              "gguf_gemv: weight must be a contiguous CPU uint8 [N, row_bytes] tensor");
  with_format(qtype, [&](auto qt) {
    using F = Format<decltype(qt)::value>;
    const int64_t block = kBlock * F::group_units;
    TORCH_CHECK(K > 0 && K % block == 0, "gguf_gemv: K must be a positive multiple of ", block);
    const int64_t expected = F::row_bytes(K / kBlock);
    TORCH_CHECK(w.size(1) == expected, "gguf_gemv: weight rows hold ", w.size(1),
                " bytes, expected ", expected);
  });
}

// x [M, K] fp32, w [N, row_bytes] uint8 (the layout above) -> y [M, N] fp32 (+ bias [N]).
at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype,
                const c10::optional<at::Tensor>& bias_in, bool vector) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "gguf_gemv: x must be a 2-D fp32 CPU tensor");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  const at::Tensor x = x_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == N,
                "gguf_gemv: bias must be fp32 [N]");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t rb = w.size(1);
  with_format(qtype, [&](auto qt) {
    gemm_typed<decltype(qt)::value>(xp, M, K, wp, rb, N, yp, bp, vector);
  });
  return y;
}

template <int QT>
void dequantize_typed(const uint8_t* w, int64_t N, int64_t K, int64_t rb, float* out,
                      bool vector) {
  using F = Format<QT>;
  const int64_t nb = K / kBlock;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> sc(nb * F::params);
    for (int64_t n = n0; n < n1; ++n) {
      prepare<QT>(w + n * rb, rb, 1, nb, sc.data());
      const uint8_t* q = w + n * rb + F::header_bytes(nb);
      for (int64_t b = 0; b < nb; ++b) {
        const float* s = sc.data() + b * F::params;
        float* o = out + n * K + b * kBlock;
#ifdef DUET_AVX512
        if (vector) {
          __m512 lo, hi;
          dequant_block_avx512<QT>(s, q + b * F::quant_bytes, lo, hi);
          _mm512_storeu_ps(o, lo);
          _mm512_storeu_ps(o + 16, hi);
          continue;
        }
#endif
        dequant_block_scalar<QT>(s, q + b * F::quant_bytes, o);
      }
    }
  });
}

// The weights exactly as the gemm sees them, for tests against gguf's dequantize.
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, bool vector) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_format(qtype, [&](auto qt) {
    dequantize_typed<decltype(qt)::value>(wp, N, K, w.size(1), op, vector);
  });
  return out;
}

bool has_vector_path() {
#ifdef DUET_AVX512
  return true;
#else
  return false;
#endif
}

}  // namespace

namespace duet {
// csrc/cpu_ops.cpp: attention, KV write and RMSNorm, compiled into this same module.
void register_cpu_ops(pybind11::module_& m);
}  // namespace duet

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &gemm, "y = x @ W^T for GGUF-quantized W", py::arg("x"), py::arg("w"),
        py::arg("qtype"), py::arg("bias") = py::none(), py::arg("vector") = true);
  m.def("dequantize", &dequantize, "W as fp32, as the gemm reads it", py::arg("w"),
        py::arg("qtype"), py::arg("k"), py::arg("vector") = true);
  m.def("has_vector_path", &has_vector_path, "built with the AVX-512 path");
  duet::register_cpu_ops(m);
}
