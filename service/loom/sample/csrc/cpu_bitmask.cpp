// A grammar's token bitmask applied to float32 logits on the CPU, in place (structured output).
//
//   apply_bitmask_(logits [N, V] float32, bitmask [N, W] int32, rows int64 [G]?) -> ()
//       logits[r, t] = -inf where bit t % 32 of bitmask[r, t / 32] is 0, for every row r of
//       `rows` (every row when None); tokens t >= V are ignored (W = ceil(V / 32)).
//
// xgrammar's CPU kernel tests every token's bit: 9-17 ms for 64 rows of SmolLM2's 49,152 logits
// on the 2-core development VM, 15-40% of a batch-64 step. A grammar's masks are mostly whole
// words: all ones inside a JSON string (nearly every token allowed), all zeros where a few
// property names or punctuation are (nearly every token refused). This kernel reads a word at a
// time, skips an all-ones word, fills an all-zeros word with 32 stores, and tests bits only in
// mixed words. Rows run on ATen's thread pool.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cstdint>
#include <limits>
#include <optional>

namespace {

void mask_row(float* logits, const int32_t* words, int64_t vocab, int64_t num_words) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0; w < num_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;  // every token of the word allowed
    const int64_t base = w * 32;
    const int64_t n = vocab - base < 32 ? vocab - base : 32;
    float* row = logits + base;
    if (bits == 0u) {
      for (int64_t j = 0; j < n; ++j) row[j] = kNegInf;
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (((bits >> j) & 1u) == 0u) row[j] = kNegInf;
    }
  }
}

void apply_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "logits must be a [N, V] float32 CPU tensor with unit stride along V");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 &&
                  bitmask.stride(1) == 1,
              "bitmask must be a [N, W] int32 CPU tensor with unit stride along W");
  const int64_t n = logits.size(0), vocab = logits.size(1), num_words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == n, "bitmask has ", bitmask.size(0), " rows for ", n, " rows of logits");
  TORCH_CHECK(num_words * 32 >= vocab && (num_words - 1) * 32 < vocab, "bitmask has ", num_words,
              " words a row for a vocabulary of ", vocab);
  float* lp = logits.data_ptr<float>();
  const int32_t* bp = bitmask.data_ptr<int32_t>();
  const int64_t ls = logits.stride(0), bs = bitmask.stride(0);
  if (rows.has_value()) {
    const at::Tensor r = rows->to(at::kLong).contiguous();
    TORCH_CHECK(r.device().is_cpu() && r.dim() == 1, "rows must be a 1-D CPU tensor");
    const int64_t* rp = r.data_ptr<int64_t>();
    const int64_t g = r.numel();
    for (int64_t i = 0; i < g; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < n, "row ", rp[i], " out of range");
    at::parallel_for(0, g, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) mask_row(lp + rp[i] * ls, bp + rp[i] * bs, vocab, num_words);
    });
  } else {
    at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) mask_row(lp + i * ls, bp + i * bs, vocab, num_words);
    });
  }
}

}  // namespace

TORCH_LIBRARY(loom_cpu_bitmask, lib) {
  lib.def("apply_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor? rows) -> ()");
}

TORCH_LIBRARY_IMPL(loom_cpu_bitmask, CPU, lib) {
  lib.impl("apply_bitmask_", &apply_bitmask_);
}
