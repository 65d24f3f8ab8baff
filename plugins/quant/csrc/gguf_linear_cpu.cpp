// Linear layers on the CPU that keep a GGUF file's block-quantized weights: y = x @ W^T, x fp32.
//
// Each weight is dequantized in registers with exactly the float operations of gguf-py (the code
// transformers uses to load the file), so the weights multiplied are the very fp32 values the
// dequantized model holds; only their bytes differ: 0.625 (Q4_0), 0.75 (Q4_1) or 1.125 (Q8_0)
// bytes a weight as stored here instead of 4. A batch-1 decode step reads every weight once.
//
// Storage, repacked once at load by quant/gguf.py from the file's blocks of 32 weights along K
// (a Q4_K block of 256 becomes eight Q4_1-form blocks: scale d * sc, minimum -(dmin * m)).
// Output columns (rows of W) come in groups of 8, one AVX2 vector; G = ceil(N / 8), padded.
//   Q4_0, Q4_1: qs [G, K/2, 8] uint8, byte (g, p, c) = q[8g+c][2p] | q[8g+c][2p+1] << 4;
//   Q8_0:       qs [G, K, 8] int8,    byte (g, k, c) = q[8g+c][k];
//   d [G, K/32, 8] float32: the block scales; m (Q4_1 only) the block minimums, same layout.
//   Q4_0: w = d * (q - 8);  Q4_1: w = d * q + m;  Q8_0: w = q * d   (gguf-py's operations, in order)
// Built with -ffp-contract=off: d * q + m rounds twice, as numpy does; it must never become an FMA.
//
// One summation order for every output element whatever M is and wherever the row sits:
// y[r][n] = fma(x[r][K-1], w[n][K-1], ... fma(x[r][1], w[n][1], x[r][0] * w[n][0] + 0)), k
// increasing. A request's result therefore does not depend on what it is batched with. The
// vectors run across 8 output columns, so each lane is one output's own sequential sum.
// Two paths share that order:
//   M <= kDirectRows: weights dequantized in registers as they are used (decode; read once);
//   larger M: a panel of columns is dequantized into a per-thread fp32 buffer that stays in L2,
//             then 6-row x 16-column register tiles sweep it for every block of rows.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the GGUF CPU kernels need AVX2 and FMA (the Python side reports them unavailable otherwise)"
#endif

namespace {

constexpr int64_t QK = 32;  // weights per GGUF block
// ggml type ids, as in the GGUF file
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kDirectRows = 2;
constexpr int64_t kPrefetchBlocks = 4;  // measured best of 2, 4, 8, 16 for SmolLM2's shapes

struct QWeights {
  const uint8_t* qs;
  const float* d;
  const float* m;  // nullptr unless Q4_1
  int64_t K;
  int64_t nb;  // blocks per row, K / 32
};

// Bytes of one group's quantized weights per pair of k.
template <int64_t T>
constexpr int64_t kPairBytes = T == kQ8_0 ? 16 : 8;

// Weights k = 2p and 2p + 1 of one group's 8 columns, with gguf-py's float operations; q points
// at the pair's bytes, d and m are the group's scale and minimum vectors of the block holding it.
template <int64_t T>
inline void dequant_pair(const uint8_t* q, __m256 d, __m256 m, __m256& even, __m256& odd) {
  if constexpr (T == kQ8_0) {
    const __m256 qe = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    const __m256 qo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))));
    even = _mm256_mul_ps(qe, d);
    odd = _mm256_mul_ps(qo, d);
  } else {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i qe = _mm256_and_si256(v, _mm256_set1_epi32(0xF));
    const __m256i qo = _mm256_srli_epi32(v, 4);
    if constexpr (T == kQ4_0) {
      const __m256i eight = _mm256_set1_epi32(8);
      even = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(qe, eight)));
      odd = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(qo, eight)));
    } else {
      even = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(qe)), m);
      odd = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(qo)), m);
    }
  }
}

// One group's storage: its quantized bytes and its per-block scales (and minimums).
template <int64_t T>
struct Group {
  const uint8_t* q;
  const float* d;
  const float* m;
  Group() : q(nullptr), d(nullptr), m(nullptr) {}
  Group(const QWeights& w, int64_t g)
      : q(w.qs + g * (w.K / 2) * kPairBytes<T>),
        d(w.d + g * w.nb * 8),
        m(T == kQ4_1 ? w.m + g * w.nb * 8 : nullptr) {}
  inline __m256 scale(int64_t b) const { return _mm256_loadu_ps(d + b * 8); }
  inline __m256 minimum(int64_t b) const { return T == kQ4_1 ? _mm256_loadu_ps(m + b * 8) : _mm256_setzero_ps(); }
  inline const uint8_t* pair(int64_t p) const { return q + p * kPairBytes<T>; }
};

// y[n .. n+7] = v, only the columns below N (the last group of a weight may be padding). The
// value is passed by copy: an accumulator whose address is taken would be kept in memory.
inline void store_group(__m256 v, float* yrow, int64_t n, int64_t N) {
  if (n + 8 <= N) {
    _mm256_storeu_ps(yrow + n, v);
  } else {
    alignas(32) float tail[8];
    _mm256_store_ps(tail, v);
    for (int64_t c = 0; n + c < N; ++c) yrow[n + c] = tail[c];
  }
}

// Few rows: NG groups' weights dequantized in registers, block by block (the scales are loaded
// once a block), each used for the MR rows at once.
template <int64_t T, int MR, int NG>
inline void direct_tile(const float* x, int64_t ldx, const QWeights& w, int64_t g0, float* y, int64_t ldy,
                        int64_t N) {
  const int64_t nb = w.nb;
  Group<T> grp[NG];
#pragma GCC unroll 4
  for (int j = 0; j < NG; ++j) grp[j] = Group<T>(w, g0 + j);
  __m256 acc[MR][NG];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 d[NG], m[NG];
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) {
      d[j] = grp[j].scale(b);
      m[j] = grp[j].minimum(b);
    }
    // The weights stream from memory once per step: ask for blocks kPrefetchBlocks ahead, since
    // the hardware prefetcher ramps up too slowly on these short per-group streams.
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) {
      const char* ahead = reinterpret_cast<const char*>(grp[j].pair((b + kPrefetchBlocks) * (QK / 2)));
      for (int64_t line = 0; line < (QK / 2) * kPairBytes<T>; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(grp[j].d + (b + kPrefetchBlocks) * 8), _MM_HINT_T0);
      if (T == kQ4_1) _mm_prefetch(reinterpret_cast<const char*>(grp[j].m + (b + kPrefetchBlocks) * 8), _MM_HINT_T0);
    }
    const float* xb = x + b * QK;
#pragma GCC unroll 2
    for (int64_t i = 0; i < QK / 2; ++i) {
      const int64_t p = b * (QK / 2) + i;
#pragma GCC unroll 4
      for (int j = 0; j < NG; ++j) {
        __m256 we, wo;
        dequant_pair<T>(grp[j].pair(p), d[j], m[j], we, wo);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + r * ldx + 2 * i), we, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + r * ldx + 2 * i + 1), wo, acc[r][j]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) store_group(acc[r][j], y + r * ldy, (g0 + j) * 8, N);
}

inline __m256 load_group(const float* yrow, int64_t n, int64_t N) {
  if (n + 8 <= N) return _mm256_loadu_ps(yrow + n);
  alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = 0; n + c < N; ++c) tail[c] = yrow[n + c];
  return _mm256_load_ps(tail);
}

// Many rows: MR rows x NG groups from a dequantized panel (groups from gp on, each [K][8]
// floats), over k in [k0, k1). Past the first k block the sums continue from y: storing and
// reloading an fp32 accumulator is exact, so the summation order is unchanged.
template <int MR, int NG>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t gp, int64_t g0, int64_t K, int64_t k0,
                       int64_t k1, float* y, int64_t ldy, int64_t N) {
  __m256 acc[MR][NG];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j)
      acc[r][j] = k0 == 0 ? _mm256_setzero_ps() : load_group(y + r * ldy, (g0 + j) * 8, N);
  const float* wp = panel + (g0 - gp) * K * 8;
  for (int64_t k = k0; k < k1; ++k) {
    __m256 wv[NG];
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) wv[j] = _mm256_loadu_ps(wp + (j * K + k) * 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NG; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) store_group(acc[r][j], y + r * ldy, (g0 + j) * 8, N);
}

template <int NG>
inline void panel_rows(int mr, const float* x, int64_t ldx, const float* panel, int64_t gp, int64_t g0, int64_t K,
                       int64_t k0, int64_t k1, float* y, int64_t ldy, int64_t N) {
  switch (mr) {
    case 1: panel_tile<1, NG>(x, ldx, panel, gp, g0, K, k0, k1, y, ldy, N); break;
    case 2: panel_tile<2, NG>(x, ldx, panel, gp, g0, K, k0, k1, y, ldy, N); break;
    case 3: panel_tile<3, NG>(x, ldx, panel, gp, g0, K, k0, k1, y, ldy, N); break;
    case 4: panel_tile<4, NG>(x, ldx, panel, gp, g0, K, k0, k1, y, ldy, N); break;
    case 5: panel_tile<5, NG>(x, ldx, panel, gp, g0, K, k0, k1, y, ldy, N); break;
    default: panel_tile<6, NG>(x, ldx, panel, gp, g0, K, k0, k1, y, ldy, N); break;
  }
}

template <int64_t T>
void linear_direct(const float* x, int64_t M, const QWeights& w, int64_t N, float* y) {
  // Tiles of 3 groups (24 columns): three independent FMA chains a row, with the three groups'
  // scales and minimums held in registers; the groups left at the end go one at a time.
  constexpr int64_t NG = 3;
  const int64_t G = (N + 7) / 8, tiles = (G + NG - 1) / NG;
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * NG;
      for (int64_t r = 0; r < M; ++r) {
        const float* xr = x + r * w.K;
        float* yr = y + r * N;
        if (g0 + NG <= G) {
          direct_tile<T, 1, NG>(xr, w.K, w, g0, yr, N, N);
        } else {
          for (int64_t g = g0; g < G; ++g) direct_tile<T, 1, 1>(xr, w.K, w, g, yr, N, N);
        }
      }
    }
  });
}

template <int64_t T>
void dequant_groups(const QWeights& w, int64_t g0, int64_t g1, float* out) {
  const int64_t K = w.K, nb = w.nb;
  for (int64_t g = g0; g < g1; ++g) {
    const Group<T> grp(w, g);
    float* o = out + (g - g0) * K * 8;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 d = grp.scale(b), m = grp.minimum(b);
      for (int64_t p = b * (QK / 2); p < (b + 1) * (QK / 2); ++p) {
        __m256 even, odd;
        dequant_pair<T>(grp.pair(p), d, m, even, odd);
        _mm256_storeu_ps(o + 2 * p * 8, even);
        _mm256_storeu_ps(o + (2 * p + 1) * 8, odd);
      }
    }
  }
}

template <int64_t T>
void linear_panels(const float* x, int64_t M, const QWeights& w, int64_t N, float* y) {
  // Blocked as a BLIS-style GEMM: a panel of 8 groups (64 columns) is dequantized once per call;
  // within it, blocks of 192 rows x 256 k: a 16-column x 256-k slice of the panel (16 KB) stays
  // in L1 while the 6-row tiles of the row block (192 KB of x) stream from L2.
  constexpr int64_t kPanelGroups = 8, kRowBlock = 192, kKBlock = 256;
  const int64_t K = w.K, G = (N + 7) / 8;
  const int64_t panels = (G + kPanelGroups - 1) / kPanelGroups;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(static_cast<size_t>(kPanelGroups * K * 8));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = p * kPanelGroups, g1 = std::min(G, g0 + kPanelGroups);
      dequant_groups<T>(w, g0, g1, buf.data());
      for (int64_t rb = 0; rb < M; rb += kRowBlock) {
        const int64_t re = std::min(M, rb + kRowBlock);
        for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
          const int64_t k1 = std::min(K, k0 + kKBlock);
          for (int64_t g = g0; g < g1; g += 2) {
            for (int64_t r = rb; r < re; r += 6) {
              const int mr = static_cast<int>(std::min<int64_t>(6, re - r));
              if (g + 2 <= g1) {
                panel_rows<2>(mr, x + r * K, K, buf.data(), g0, g, K, k0, k1, y + r * N, N, N);
              } else {
                panel_rows<1>(mr, x + r * K, K, buf.data(), g0, g, K, k0, k1, y + r * N, N, N);
              }
            }
          }
        }
      }
    }
  });
}

QWeights weights_of(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0,
              "unsupported GGUF type id ", qtype, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  TORCH_CHECK(qs.device().is_cpu() && d.device().is_cpu() && m.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(qs.dim() == 3 && d.dim() == 3 && qs.is_contiguous() && d.is_contiguous() && m.is_contiguous(),
              "qs and d must be contiguous 3-D tensors");
  const bool q8 = qtype == kQ8_0;
  const int64_t G = d.size(0), nb = d.size(1), K = nb * QK;
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.size(2) == 8, "d must be float32 [G, K/32, 8]");
  TORCH_CHECK(qs.scalar_type() == (q8 ? at::kChar : at::kByte), "qs must be ", q8 ? "int8" : "uint8");
  TORCH_CHECK(qs.size(0) == G && qs.size(1) == (q8 ? K : K / 2) && qs.size(2) == 8,
              "qs must be [G, ", q8 ? "K" : "K/2", ", 8]");
  if (qtype == kQ4_1) {
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.sizes() == d.sizes(), "m must be float32 [G, K/32, 8] for Q4_1");
  }
  return QWeights{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<float>(),
                  qtype == kQ4_1 ? m.data_ptr<float>() : nullptr, K, nb};
}

template <int64_t T>
void linear_impl(const float* x, int64_t M, const QWeights& w, int64_t N, float* y) {
  if (M <= kDirectRows) {
    linear_direct<T>(x, M, w, N, y);
  } else {
    linear_panels<T>(x, M, w, N, y);
  }
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       int64_t qtype, int64_t N) {
  const QWeights w = weights_of(qs, d, m, qtype);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) == w.K, "x has ", x.size(1), " features but the weight has ", w.K);
  TORCH_CHECK(N > (d.size(0) - 1) * 8 && N <= d.size(0) * 8, "N does not match the weight's column groups");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (qtype) {
    case kQ4_0: linear_impl<kQ4_0>(xp, M, w, N, yp); break;
    case kQ4_1: linear_impl<kQ4_1>(xp, M, w, N, yp); break;
    default: linear_impl<kQ8_0>(xp, M, w, N, yp); break;
  }
  return y;
}

// The dense weight [N, K] (tests, and devices without this kernel).
at::Tensor gguf_dequantize(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t qtype, int64_t N) {
  const QWeights w = weights_of(qs, d, m, qtype);
  const int64_t G = d.size(0), K = w.K;
  TORCH_CHECK(N > (G - 1) * 8 && N <= G * 8, "N does not match the weight's column groups");
  at::Tensor grouped = at::empty({G, K, 8}, d.options());
  float* op = grouped.data_ptr<float>();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    switch (qtype) {
      case kQ4_0: dequant_groups<kQ4_0>(w, g0, g1, op + g0 * K * 8); break;
      case kQ4_1: dequant_groups<kQ4_1>(w, g0, g1, op + g0 * K * 8); break;
      default: dequant_groups<kQ8_0>(w, g0, g1, op + g0 * K * 8); break;
    }
  });
  return grouped.permute({0, 2, 1}).reshape({G * 8, K}).narrow(0, 0, N).contiguous();
}

}  // namespace

TORCH_LIBRARY(loom_gguf_cpu, lib) {
  lib.def("linear(Tensor x, Tensor qs, Tensor d, Tensor m, int qtype, int n) -> Tensor");
  lib.def("dequantize(Tensor qs, Tensor d, Tensor m, int qtype, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom_gguf_cpu, CPU, lib) {
  lib.impl("linear", &gguf_linear);
  lib.impl("dequantize", &gguf_dequantize);
}
