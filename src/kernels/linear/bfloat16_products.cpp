// bfloat16 products rounded in cache (see bfloat16_products.h).
#include "kernels/linear/bfloat16_products.h"

#include "kernels/bfloat16_bits.h"
#include "kernels/linear/onednn_gemm.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

// at::parallel_for is an inline `#pragma omp parallel` in an OpenMP build of LibTorch: compiled
// without OpenMP it is a loop on one thread (src/CMakeLists.txt gives this file -fopenmp).
#if AT_PARALLEL_OPENMP && defined(QKV_OPENMP_FOUND) && !defined(_OPENMP)
#error "bfloat16_products.cpp calls at::parallel_for: compile it with OpenMP (src/CMakeLists.txt)"
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QKV_ROUNDING_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define QKV_ROUNDING_CLONES
#endif

namespace qkv::kernels::linear {

namespace {

// Values per task of at::parallel_for for a rounding pass: enough to pay for another thread.
constexpr int64_t kRoundingGrain = 1 << 15;

// Rows per task of a product: its float32 block (256 × 512 × 4 bytes at the lm's widest) stays in
// a core's L2 until it is rounded. Measured on AMD EPYC Zen 5 (2 threads, 4096 rows, 128 → 512,
// operands in cache): 256-row blocks 0.72 ms, one call over all rows then a rounding pass 0.73 ms,
// 64- and 128-row blocks slower (0.79, 0.89 ms); in the lm's step, where the whole output went to
// memory and back, the blocks made the bfloat16 step 7% faster.
constexpr int64_t kRowsPerTask = 256;

QKV_ROUNDING_CLONES void round_values(const float* __restrict from, uint16_t* __restrict into, int64_t count) {
  for (int64_t i = 0; i < count; ++i) into[i] = float_to_bfloat16_bits(from[i]);
}

QKV_ROUNDING_CLONES void round_values_kept_float32(const float* __restrict from, float* __restrict into, int64_t count) {
  for (int64_t i = 0; i < count; ++i) into[i] = bfloat16_bits_to_float(float_to_bfloat16_bits(from[i]));
}

QKV_ROUNDING_CLONES void widen_values(const uint16_t* __restrict from, float* __restrict into, int64_t count) {
  for (int64_t i = 0; i < count; ++i) into[i] = bfloat16_bits_to_float(from[i]);
}

const uint16_t* bits_of(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace

at::Tensor round_to_bfloat16(const at::Tensor& t) {
  if (t.scalar_type() != at::kFloat || !t.is_contiguous() || !t.device().is_cpu()) return t.to(at::kBFloat16);
  auto out = at::empty(t.sizes(), t.options().dtype(at::kBFloat16));
  const float* from = t.data_ptr<float>();
  auto* into = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, t.numel(), kRoundingGrain,
                   [&](int64_t begin, int64_t end) { round_values(from + begin, into + begin, end - begin); });
  return out;
}

at::Tensor float32_to(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype) return t;
  return dtype == at::kBFloat16 ? round_to_bfloat16(t) : t.to(dtype);
}

at::Tensor bfloat16_values(const at::Tensor& t) {
  const bool in_place = t.is_contiguous() && t.device().is_cpu();
  if (!in_place || (t.scalar_type() != at::kFloat && t.scalar_type() != at::kBFloat16)) {
    return t.to(at::kBFloat16).to(at::kFloat);
  }
  auto out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  float* into = out.data_ptr<float>();
  if (t.scalar_type() == at::kFloat) {
    const float* from = t.data_ptr<float>();
    at::parallel_for(0, t.numel(), kRoundingGrain, [&](int64_t begin, int64_t end) {
      round_values_kept_float32(from + begin, into + begin, end - begin);
    });
  } else {
    const uint16_t* from = bits_of(t);
    at::parallel_for(0, t.numel(), kRoundingGrain,
                     [&](int64_t begin, int64_t end) { widen_values(from + begin, into + begin, end - begin); });
  }
  return out;
}

at::Tensor bfloat16_product(int64_t m, int64_t n, int64_t k, const GemmOperand& a, const GemmOperand& b,
                            const at::Tensor& bias) {
  TORCH_CHECK(!a.transposed, "qkv: bfloat16_product splits the rows of its left operand: it cannot be transposed");
  const auto type = a.tensor.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && b.tensor.scalar_type() == type,
              "qkv: bfloat16_product expected two bfloat16 or two float32 operands, got ", type, " and ",
              b.tensor.scalar_type());
  const auto& gemm = OneDnnGemm::instance();
  auto out = at::empty({m, n}, a.tensor.options().dtype(at::kBFloat16));
  const auto bias_values = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_row = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  // (rows × n) into `block` = the rows of A from `first` on times B, + block where there is a bias.
  const auto multiply = [&](int64_t first, int64_t rows, float* block) {
    const float beta = bias_row ? 1.0f : 0.0f;
    if (type == at::kBFloat16) {
      gemm.multiply_bf16(false, b.transposed, rows, n, k, bits_of(a.tensor) + first * a.ld, a.ld, bits_of(b.tensor),
                         b.ld, beta, block, n);
    } else {
      gemm.multiply(false, b.transposed, rows, n, k, a.tensor.data_ptr<float>() + first * a.ld, a.ld,
                    b.tensor.data_ptr<float>(), b.ld, beta, block, n);
    }
  };
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  // Inside a task oneDNN's GEMM sees it runs in a parallel region and stays on the task's thread.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block(static_cast<size_t>(std::min(kRowsPerTask, m) * n));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task * kRowsPerTask, rows = std::min(kRowsPerTask, m - first);
      if (bias_row) {
        for (int64_t r = 0; r < rows; ++r) std::copy(bias_row, bias_row + n, block.data() + r * n);
      }
      multiply(first, rows, block.data());
      round_values(block.data(), out_bits + first * n, rows * n);
    }
  });
  return out;
}

at::Tensor bfloat16_column_sums(const at::Tensor& rows) {
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && rows.dim() == 2 && rows.is_contiguous(),
              "qkv: bfloat16_column_sums expected a contiguous bfloat16 matrix, got ", rows.scalar_type(), " ",
              rows.sizes());
  const int64_t m = rows.size(0), n = rows.size(1);
  auto sums = at::empty({n}, rows.options().dtype(at::kFloat));
  const auto ones = at::ones({m}, rows.options());
  // (1 × n) = ones (1 × m) · rows (m × n)
  OneDnnGemm::instance().multiply_bf16(false, false, 1, n, m, bits_of(ones), m, bits_of(rows), n, 0.0f,
                                       sums.data_ptr<float>(), n);
  return sums;
}

}  // namespace qkv::kernels::linear
