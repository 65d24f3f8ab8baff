// Decode attention on the CPU that reads K/V straight from the paged pool (fp32).
//
// One query token per sequence. The g = Hq / Hkv query heads that share a KV head are attended
// together, so every key and value row is read from the pool once, where it lies (block_tables[b][t / block_size], offset t % block_size): no gathered
// copy of the context is made. Work items run on ATen's thread pool (the one torch's own ops
// use), so the kernel never competes with a second OpenMP runtime for the cores.
//
// The item's key and value rows are located once, block by block. Then per query head, three
// passes over the context (exact softmax, as SDPA's result):
//   1. s[j][t] = scale * <q_j, k_t>, four keys at a time (one horizontal sum for four), and m_j;
//   2. p[j][t] = exp(s[j][t] - m_j) / sum_t exp(s[j][t] - m_j), the exp in 8 lanes;
//   3. out_j = sum_t p[j][t] * v_t, 32 output lanes held in registers across all keys.
//
// Shapes: q [B, Hq, D], kv_cache [2, num_blocks, block_size, Hkv, D], block_tables [B, W] int32,
// seq_lens [B] int32; out [B, Hq, D]. A sliding window w > 0 keeps keys t >= seq_len - w.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "loom_vec_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// s[i] = exp(s[i] - m) for i < n; returns their sum.
inline float exp_shifted_sum(float* s, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = loom::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// <q, k_j> for four keys at once: one horizontal reduction for the four sums.
inline void dot4(const float* __restrict q, const float* const* k, int64_t d, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  for (; i < d; ++i) {
    for (int j = 0; j < 4; ++j) out[j] += q[i] * k[j][i];
  }
}

// out[0:32] += sum_j p[j] * v_j[0:32] over n rows, accumulated in registers.
inline void weighted_sum32(const float* p, const float* const* v, int64_t n, float* __restrict out) {
  __m256 a0 = _mm256_loadu_ps(out), a1 = _mm256_loadu_ps(out + 8);
  __m256 a2 = _mm256_loadu_ps(out + 16), a3 = _mm256_loadu_ps(out + 24);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j]), a0);
    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + 8), a1);
    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + 16), a2);
    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + 24), a3);
  }
  _mm256_storeu_ps(out, a0);
  _mm256_storeu_ps(out + 8, a1);
  _mm256_storeu_ps(out + 16, a2);
  _mm256_storeu_ps(out + 24, a3);
}
constexpr bool kHaveVectorHelpers = true;

inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t d) {
  const __m256 vw = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < d; ++i) y[i] += w * x[i];
}
#else
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  // Eight independent partial sums: the compiler can turn them into SIMD lanes.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0;
  for (; i < d; ++i) s += a[i] * b[i];
  return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] += w * x[i];
}

inline void dot4(const float* __restrict q, const float* const* k, int64_t d, float* out) {
  for (int j = 0; j < 4; ++j) out[j] = dot(q, k[j], d);
}

inline void weighted_sum32(const float* p, const float* const* v, int64_t n, float* __restrict out) {
  for (int64_t j = 0; j < n; ++j) axpy(p[j], v[j], out, 32);
}
constexpr bool kHaveVectorHelpers = false;

inline float exp_shifted_sum(float* s, int64_t n, float m) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}
#endif

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && seq_lens.dim() == 1,
              "bad ranks");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(), "contiguous tensors only");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == D, "kv_cache must be [2, N, bs, Hkv, D]");
  TORCH_CHECK(Hq % Hkv == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "one table row and length per sequence");
  const int64_t g = Hq / Hkv, W = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t total_keys = 0;
  for (int64_t b = 0; b < B; ++b) {  // checked once here, not per key inside the loop
    total_keys += lens[b];
    TORCH_CHECK(lens[b] >= 0 && (lens[b] + bs - 1) / bs <= W, "seq_len exceeds its block table");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i) {
      TORCH_CHECK(tables[b * W + i] >= 0 && tables[b * W + i] < num_blocks, "block id out of range");
    }
  }
  auto out = at::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + num_blocks * bs * Hkv * D;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats between consecutive slots of one block

  // A work item is a sequence with a range of its KV heads. Slots hold all heads side by side,
  // so taking every head at once walks each block front to back (12 KB runs for SmolLM2) instead
  // of striding through it once per head. Sequences are split by head only when there are too
  // few of them to keep every thread busy (batch 1).
  const int64_t threads = at::get_num_threads();
  const int64_t per_item = B >= 2 * threads ? Hkv : 1;
  const int64_t chunks = Hkv / per_item;
  // Little work (a short batch-1 context) runs on the calling thread: waking the pool's other
  // threads costs more than it saves.
  const int64_t grain = total_keys * Hq < 16384 ? B * chunks : 1;
  at::parallel_for(0, B * chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s, m(per_item * g);
    std::vector<const float*> kslots, vslots;  // each key's K and V row of the item's first head
    std::vector<const float*> chunk;  // V rows offset to the output chunk being summed
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / chunks, h0 = (item % chunks) * per_item;
      const int64_t len = lens[b];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - start;
      if (n <= 0) continue;
      const int64_t rows = per_item * g;  // query heads of this item: h0 * g .. (h0 + per_item) * g
      s.resize(rows * n);
      kslots.resize(n);
      vslots.resize(n);
      const int32_t* table = tables + b * W;
      for (int64_t t = start; t < len;) {  // block by block: no division per key
        const int64_t blk = t / bs, off = t % bs, take = std::min(bs - off, len - t);
        const int64_t base = (static_cast<int64_t>(table[blk]) * bs + off) * row + h0 * D;
        for (int64_t j = 0; j < take; ++j) {
          kslots[t - start + j] = kp + base + j * row;
          vslots[t - start + j] = vp + base + j * row;
        }
        t += take;
      }
      const float* qb = qp + (b * Hq + h0 * g) * D;
      float* ob = op + (b * Hq + h0 * g) * D;
      for (int64_t r = 0; r < rows; ++r) {  // query head r reads KV head r / g of each slot
        const int64_t kv_off = (r / g) * D;
        float* sr = s.data() + r * n;
        float mr = -INFINITY;
        int64_t i = 0;
        const float* ks[4];
        for (; i + 4 <= n; i += 4) {
          for (int j = 0; j < 4; ++j) ks[j] = kslots[i + j] + kv_off;
          dot4(qb + r * D, ks, D, sr + i);
        }
        for (; i < n; ++i) sr[i] = dot(qb + r * D, kslots[i] + kv_off, D);
        for (i = 0; i < n; ++i) {
          sr[i] *= sc;
          mr = std::max(mr, sr[i]);
        }
        m[r] = mr;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / exp_shifted_sum(s.data() + r * n, n, m[r]);
        float* sr = s.data() + r * n;
        for (int64_t i = 0; i < n; ++i) sr[i] *= inv;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t kv_off = (r / g) * D;
        const float* pr = s.data() + r * n;
        float* orow = ob + r * D;
        int64_t c = 0;
        if (kHaveVectorHelpers) {
          // 32 output lanes at a time held in registers across every key
          chunk.resize(n);
          for (; c + 32 <= D; c += 32) {
            for (int64_t i = 0; i < n; ++i) chunk[i] = vslots[i] + kv_off + c;
            weighted_sum32(pr, chunk.data(), n, orow + c);
          }
        }
        if (c < D) {
          for (int64_t i = 0; i < n; ++i) axpy(pr[i], vslots[i] + kv_off + c, orow + c, D - c);
        }
      }
    }
  });
  return out;
}

// k, v [T, Hkv, D] (rows may be strided: v is a slice of the fused qkv projection) into the pool
// [2, num_blocks, bs, Hkv, D] at flat slots (block * bs + offset): one operator instead of the
// six a pair of index_copy_ calls on pool views costs.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache, const at::Tensor& slots) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "kv_cache must be [2, N, bs, Hkv, D]");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), Hkv = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == Hkv && k.size(2) == D && v.sizes() == k.sizes(),
              "k and v must be [T, Hkv, D] matching the pool");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "k and v must be contiguous within a token");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
                  slots.is_contiguous(), "slots must be int64 [T]");
  const int64_t T = k.size(0), row = Hkv * D;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + num_slots * row;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    std::copy(kp + t * ks, kp + t * ks + row, kc + sp[t] * row);
    std::copy(vp + t * vs, vp + t * vs + row, vc + sp[t] * row);
  }
}

}  // namespace

TORCH_LIBRARY(loom_cpu, lib) {
  lib.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
          "float scale, int sliding_window) -> Tensor");
  lib.impl("paged_decode_attention", paged_decode_attention);
  lib.def("write_kv(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots) -> ()");
  lib.impl("write_kv", write_kv);
}
