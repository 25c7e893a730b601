// y[M, N] = x[M, K] @ W^T for W stored as GGUF blocks (Q4_0, Q4_1, Q8_0), fp32 in and out.
//
// Decode on CPU is bound by streaming the weights, and these formats are 4.5-8.5 bits per
// weight instead of fp32's 32. Each weight is dequantized exactly as gguf's numpy
// `dequantize` does it (fp32 ops, rounded after each one: built with -ffp-contract=off so
// that d*q + m never becomes one fused multiply-add), then multiplied into fp32
// accumulators, so the result differs from `x @ dequantized.T` only in summation order.
//
// Layout (made by gguf_linear.QuantizedWeight.from_gguf): one row per output feature, the
// row's bytes being the file's blocks with their fp16 scales moved to the front:
//   Q4_0: [d_0 .. d_nb-1][16 nibble bytes x nb]        18 bytes a block
//   Q4_1: [d_0 m_0 .. d_nb-1 m_nb-1][16 bytes x nb]    20 bytes a block
//   Q8_0: [d_0 .. d_nb-1][32 int8 x nb]                34 bytes a block
// Same bytes as the file, but the scales of a row sit together, so the vector path turns
// them to fp32 16 at a time into a small buffer and broadcasts them from memory; converting
// and broadcasting each block's scale in the inner loop made it 1.5-2x slower at one row.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DUET_AVX512 1
#include <immintrin.h>
#endif

namespace {

// ggml's type ids, as gguf.GGMLQuantizationType numbers them.
constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ8_0 = 8;
constexpr int kBlock = 32;
// Rows per task unit: their blocks stay in L1 while every 8-row slice of x passes over them.
constexpr int64_t kTileRows = 16;
#ifndef DUET_PREFETCH_BYTES
#define DUET_PREFETCH_BYTES 16384
#endif
constexpr int64_t kPrefetchBytes = DUET_PREFETCH_BYTES;

template <int QT>
struct Format {
  static constexpr int scales = QT == kQ4_1 ? 2 : 1;  // fp16 values per block
  static constexpr int quant_bytes = QT == kQ8_0 ? 32 : 16;
  static constexpr int block_bytes = 2 * scales + quant_bytes;
};

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0:
      return Format<kQ4_0>::block_bytes;
    case kQ4_1:
      return Format<kQ4_1>::block_bytes;
    case kQ8_0:
      return Format<kQ8_0>::block_bytes;
    default:
      TORCH_CHECK(false, "gguf_gemv: unsupported GGML type ", qtype);
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
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

// ---- scalar path: the build for CPUs without AVX-512, and a cross-check for the vector one.

template <int QT>
inline void dequant_block_scalar(const float* sc, const uint8_t* q, float* w) {
  const float d = sc[0];
  if constexpr (QT == kQ8_0) {
    for (int i = 0; i < kBlock; ++i) w[i] = static_cast<float>(static_cast<int8_t>(q[i])) * d;
  } else if constexpr (QT == kQ4_1) {
    const float m = sc[1];
    for (int i = 0; i < 16; ++i) {
      // gguf: (d * q) + m, two roundings; the low nibbles are elements 0..15.
      const float lo = d * static_cast<float>(q[i] & 0x0F);
      const float hi = d * static_cast<float>(q[i] >> 4);
      w[i] = lo + m;
      w[16 + i] = hi + m;
    }
  } else {
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>((q[i] & 0x0F) - 8);
      w[16 + i] = d * static_cast<float>((q[i] >> 4) - 8);
    }
  }
}

// Output features [n0, n1) for x rows [0, mc), mc <= 8; `sc` holds the rows' fp32 scales.
// The 16 lanes are independent, so the compiler vectorizes without reassociating anything.
template <int QT>
void rows_scalar(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                 const float* sc, int64_t n0, int64_t n1, int64_t mc, float* y, int64_t N,
                 const float* bias) {
  using F = Format<QT>;
  const int64_t nb = K / kBlock;
  float wb[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[8][16] = {};
    const uint8_t* q = w + n * row_bytes + nb * 2 * F::scales;
    const float* s = sc + (n - n0) * nb * F::scales;
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block_scalar<QT>(s + b * F::scales, q + b * F::quant_bytes, wb);
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

// One block as two vectors: elements 0..15 and 16..31.
template <int QT>
inline void dequant_block_avx512(const float* sc, const uint8_t* q, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(sc[0]);
  if constexpr (QT == kQ8_0) {
    const __m512i lo8 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i hi8 =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo8), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(hi8), d);
  } else {
    // A 4-bit block has only 16 distinct values: compute them once, in gguf's exact fp32
    // steps, and look each nibble up with a lane permute (which reads only the index's low
    // 4 bits, so the low nibble needs no mask).
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if constexpr (QT == kQ4_1) {
      table = _mm512_add_ps(_mm512_mul_ps(d, iota), _mm512_set1_ps(sc[1]));
    } else {
      table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    }
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
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
  const uint8_t* q = w + n * row_bytes + nb * 2 * F::scales;
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
      dequant_block_avx512<QT>(sc + (r * nb + b) * F::scales,
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
  const int64_t stride = K / kBlock * Format<QT>::scales;
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
// lanes at the end. Past 8 rows, x is transposed to [K][M padded to 16] and the loop
// becomes a BLAS-style micro-kernel: NR weight rows x 16V rows of x in registers, each
// weight broadcast and multiplied into 16 x rows per FMA. A block of each of the NR rows is
// dequantized into a 1.5 KiB buffer that stays in L1 (a whole tile of dequantized rows
// lives in L2 and writing it cost as much as the FMAs); the 32 k-steps that follow read it.
// Each output is still one fp32 FMA chain over k, as in the dot-product path.
constexpr int64_t kDotRows = 8;  // the most rows the dot-product path takes
constexpr int64_t kOuterRows = 48;  // weight rows per task unit: 2 x 24 or 4 x 12

// Outputs n .. n+NR-1 for x rows m0 .. m0+16V-1 (those below M are stored). `q` is row
// n's first quant byte (rows row_bytes apart), `sc` the NR rows' fp32 scales, nb apart.
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
  const uint8_t* ahead = q - nb * 2 * F::scales + NR * row_bytes;
  const int64_t ahead_step = NR * row_bytes / nb;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t line = 0; line < ahead_step; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * ahead_step + line), _MM_HINT_T0);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* qr = q + r * row_bytes;
      __m512 lo, hi;
      dequant_block_avx512<QT>(sc + (r * nb + b) * F::scales, qr + b * F::quant_bytes, lo, hi);
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
  const uint8_t* q = w + n0 * row_bytes + nb * 2 * F::scales;
  const int64_t stride = nb * F::scales;
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
  const int64_t per_row = nb * Format<QT>::scales;
  const int64_t mp = (M + 15) / 16 * 16;
  std::vector<float> xt(K * mp, 0.0f);
  // k outer: the writes run along xt's rows; the M reads are M short streams.
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < M; ++m) xt[k * mp + m] = x[m * K + k];
  const int64_t tiles = (N + kOuterRows - 1) / kOuterRows;
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / (kOuterRows * row_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scales(kOuterRows * per_row);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kOuterRows;
      const int64_t rows = std::min(kOuterRows, N - n0);
      convert_scales(w + n0 * row_bytes, row_bytes, rows, per_row, scales.data());
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
  if (vector && M > kDotRows) return gemm_outer<QT>(x, M, K, w, row_bytes, N, y, bias);
#endif
  const int64_t per_row = K / kBlock * Format<QT>::scales;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  // Split only where each task gets at least ~256 KiB of weights: below that the fork/join
  // costs more than a second thread saves.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / (kTileRows * row_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scales(kTileRows * per_row);
    const int64_t n_end = std::min(N, t1 * kTileRows);
    for (int64_t n0 = t0 * kTileRows; n0 < n_end; n0 += kTileRows) {
      const int64_t n1 = std::min(n_end, n0 + kTileRows);
      convert_scales(w + n0 * row_bytes, row_bytes, n1 - n0, per_row, scales.data());
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
  TORCH_CHECK(K > 0 && K % kBlock == 0, "gguf_gemv: K must be a positive multiple of 32");
  TORCH_CHECK(w.size(1) == K / kBlock * block_bytes(qtype), "gguf_gemv: weight rows hold ",
              w.size(1), " bytes, expected ", K / kBlock * block_bytes(qtype));
}

// x [M, K] fp32, w [N, K / 32 * block_bytes] uint8 -> y [M, N] fp32 (+ bias [N]).
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
  switch (qtype) {
    case kQ4_0:
      gemm_typed<kQ4_0>(xp, M, K, wp, rb, N, yp, bp, vector);
      break;
    case kQ4_1:
      gemm_typed<kQ4_1>(xp, M, K, wp, rb, N, yp, bp, vector);
      break;
    case kQ8_0:
      gemm_typed<kQ8_0>(xp, M, K, wp, rb, N, yp, bp, vector);
      break;
    default:
      TORCH_CHECK(false, "gguf_gemv: unsupported GGML type ", qtype);
  }
  return y;
}

template <int QT>
void dequantize_typed(const uint8_t* w, int64_t N, int64_t K, int64_t rb, float* out,
                      bool vector) {
  using F = Format<QT>;
  const int64_t nb = K / kBlock;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> sc(nb * F::scales);
    for (int64_t n = n0; n < n1; ++n) {
      convert_scales(w + n * rb, rb, 1, nb * F::scales, sc.data());
      const uint8_t* q = w + n * rb + nb * 2 * F::scales;
      for (int64_t b = 0; b < nb; ++b) {
        const float* s = sc.data() + b * F::scales;
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
  switch (qtype) {
    case kQ4_0:
      dequantize_typed<kQ4_0>(wp, N, K, w.size(1), op, vector);
      break;
    case kQ4_1:
      dequantize_typed<kQ4_1>(wp, N, K, w.size(1), op, vector);
      break;
    case kQ8_0:
      dequantize_typed<kQ8_0>(wp, N, K, w.size(1), op, vector);
      break;
    default:
      TORCH_CHECK(false, "gguf_gemv: unsupported GGML type ", qtype);
  }
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
