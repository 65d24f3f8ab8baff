// The elementwise work of a Llama-family layer on the CPU (float32), one operator per group, as
// fused_ops.py does with Triton on CUDA. Unfused, a batch-1 decode step on two cores spends more
// time dispatching small torch ops (RMSNorm alone is seven, RoPE about twenty) than computing.
//
//   add_rms_norm(x, residual?, weight, eps) -> (out, h): h = residual + x (or x), then HF's RMSNorm
//       out = weight * (h * rsqrt(mean(h * h) + eps)), each product rounded as torch rounds it;
//       only the sum of squares is reduced in another order (8 lanes, then pairs).
//   rotary(positions, q, k, cos, sin) -> (q', k'): rotate-half RoPE at each token's position,
//       (x1 * cos - x2 * sin, x2 * cos + x1 * sin): the torch path's exact roundings.
//   silu_and_mul(x) -> silu(gate) * up of a fused [gate | up] projection (exp to an ulp or so).
//
// Built with -ffp-contract=off so that no product and sum are fused into an FMA the torch path
// does not do. Rows run on ATen's thread pool when there are enough of them.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "loom_vec_math.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, H] with unit stride along H");
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.size(0) == H && weight.is_contiguous(), "weight must be float32 [H]");
  const bool add = residual.has_value();
  if (add) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == H, "residual must match x");
  }
  at::Tensor out = at::empty({T, H}, x.options());
  at::Tensor h = add ? at::empty({T, H}, x.options()) : x;
  const float* xp = x.data_ptr<float>();
  const float* rp = add ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = add ? residual->stride(0) : 0, hs = h.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * xs;
      float* hr = hp + t * hs;
      if (add) {
        const float* rr = rp + t * rs;
        for (int64_t i = 0; i < H; ++i) hr[i] = rr[i] + xr[i];
      }
      const float* src = add ? hr : xr;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight partial sums: SIMD lanes
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) {
        for (int j = 0; j < 8; ++j) lanes[j] += src[i + j] * src[i + j];
      }
      float tail = 0;
      for (; i < H; ++i) tail += src[i] * src[i];
      const float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])) + tail;
      const float variance = sum / static_cast<float>(H);
      const float inv = 1.0f / std::sqrt(variance + feps);
      float* orow = op + t * H;
      for (int64_t j = 0; j < H; ++j) {
        const float normed = src[j] * inv;
        orow[j] = wp[j] * normed;
      }
    }
  });
  return {out, h};
}

// One tensor [T, heads, D] (rows may be strided, as slices of a fused qkv projection are);
// positions already checked against the table.
at::Tensor rotate(const at::Tensor& x, const int64_t* pos, const float* cos, const float* sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3, "q and k must be float32 [T, H, D]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "q and k must be contiguous within a token");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        const float* x1 = xp + t * xs + hd * D;
        const float* x2 = x1 + half;
        float* o1 = op + (t * heads + hd) * D;
        float* o2 = o1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i] * c[i], b = x2[i] * s[i];
          const float e = x2[i] * c[i], f = x1[i] * s[i];
          o1[i] = a - b;
          o2[i] = e + f;
        }
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous(), "positions must be a contiguous int64 [T] CPU tensor");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous float32 [P, D/2]");
  TORCH_CHECK(q.size(0) == positions.size(0) && k.size(0) == positions.size(0), "one position per token");
  TORCH_CHECK(q.size(2) == 2 * cos.size(1) && k.size(2) == q.size(2), "head_dim must be twice the table width");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the RoPE table");
  }
  return {rotate(q, pos, cos.data_ptr<float>(), sin.data_ptr<float>()),
          rotate(k, pos, cos.data_ptr<float>(), sin.data_ptr<float>())};
}

// silu(gate) * up of a fused [T, 2I] gate_up projection -> [T, I], silu(g) = g / (1 + exp(-g)).
// The exp is computed in 8 lanes (torch's silu uses a vectorized exp of its own): the two agree
// to an ulp or so.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * I, "x must be [T, 2I]");
  at::Tensor out = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* gate = xp + t * xs;
      const float* up = gate + I;
      float* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = loom::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < I; ++i) {
        const float e = std::exp(-gate[i]);
        const float silu = gate[i] / (1.0f + e);
        o[i] = silu * up[i];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(loom_cpu_fused, lib) {
  lib.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  lib.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  lib.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom_cpu_fused, CPU, lib) {
  lib.impl("add_rms_norm", &add_rms_norm);
  lib.impl("rotary", &rotary);
  lib.impl("silu_and_mul", &silu_and_mul);
}
