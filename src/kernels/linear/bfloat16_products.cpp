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

QKV_ROUNDING_CLONES void widen_values(const uint16_t* __restrict from, float* __restrict into, int64_t count) {
  for (int64_t i = 0; i < count; ++i) into[i] = bfloat16_bits_to_float(from[i]);
}

const uint16_t* bits_of(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// The length of the sum multiplied per chunk on the float32 GEMM: a 256-row block's chunk of A and
// a chunk of a 512-wide B take 256 KiB and 512 KiB of float32.
constexpr int64_t kSumChunk = 256;

// rows × cols bfloat16 values (row stride ld) widened into a contiguous float32 block.
void widen_block(const uint16_t* from, int64_t ld, int64_t rows, int64_t cols, float* into) {
  for (int64_t r = 0; r < rows; ++r) widen_values(from + r * ld, into + r * cols, cols);
}

// Chunks of the sum per task where multiply_bfloat16 splits a long sum among the threads.
constexpr int64_t kChunksPerGroup = 4;

// op(B) for multiply_widened: its bfloat16 bits (row stride ld, widened chunk by chunk), or, where
// every block of C's rows reads all of it, widened once beforehand (widen_whole; ld its row stride).
struct RightOperand {
  const uint16_t* bits = nullptr;
  const float* widened = nullptr;
  int64_t ld = 0;
};

// op(B) as stored (k × n, or n × k transposed), widened to a contiguous float32 matrix.
std::vector<float> widen_whole(bool transposed, int64_t k, int64_t n, const uint16_t* b, int64_t ldb) {
  const int64_t rows = transposed ? n : k, cols = transposed ? k : n;
  std::vector<float> widened(static_cast<size_t>(rows * cols));
  widen_block(b, ldb, rows, cols, widened.data());
  return widened;
}

// multiply_bfloat16 on the float32 GEMM, on this thread (or oneDNN's, outside a parallel region):
// the sum over k in chunks, each chunk's part of op(A) (m × chunk) and, unless it came widened, of
// op(B) (chunk × n) widened into scratch as stored (a transposed operand stays transposed), then
// multiplied into C.
void multiply_widened(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const uint16_t* a,
                      int64_t lda, const RightOperand& b, float beta, float* c, int64_t ldc) {
  const auto& onednn = OneDnnGemm::instance();
  const int64_t chunk_size = std::min(k, kSumChunk);
  std::vector<float> a_chunk(static_cast<size_t>(m * chunk_size));
  std::vector<float> b_chunk(b.widened ? 0 : static_cast<size_t>(chunk_size * n));
  for (int64_t first = 0; first < k; first += kSumChunk) {
    const int64_t chunk = std::min(kSumChunk, k - first);
    // op(A)[:, first:first+chunk]: rows of Aᵀ's storage (chunk × m), or a column block (m × chunk)
    const int64_t a_ld = transpose_a ? m : chunk;
    if (transpose_a) {
      widen_block(a + first * lda, lda, chunk, m, a_chunk.data());
    } else {
      widen_block(a + first, lda, m, chunk, a_chunk.data());
    }
    // op(B)[first:first+chunk, :]: a column block of Bᵀ's storage (n × chunk), or rows (chunk × n)
    const float* b_part = nullptr;
    int64_t b_ld = b.ld;
    if (b.widened) {
      b_part = transpose_b ? b.widened + first : b.widened + first * b.ld;
    } else {
      b_ld = transpose_b ? chunk : n;
      if (transpose_b) {
        widen_block(b.bits + first, b.ld, n, chunk, b_chunk.data());
      } else {
        widen_block(b.bits + first * b.ld, b.ld, chunk, n, b_chunk.data());
      }
      b_part = b_chunk.data();
    }
    onednn.multiply(transpose_a, transpose_b, m, n, chunk, a_chunk.data(), a_ld, b_part, b_ld,
                    first == 0 ? beta : 1.0f, c, ldc);
  }
}

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
  if (t.scalar_type() == at::kFloat) return bfloat16_values(round_to_bfloat16(t));
  if (t.scalar_type() != at::kBFloat16 || !t.is_contiguous() || !t.device().is_cpu()) {
    return t.to(at::kBFloat16).to(at::kFloat);
  }
  auto out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  const uint16_t* from = bits_of(t);
  float* into = out.data_ptr<float>();
  at::parallel_for(0, t.numel(), kRoundingGrain,
                   [&](int64_t begin, int64_t end) { widen_values(from + begin, into + begin, end - begin); });
  return out;
}

void multiply_bfloat16(Bfloat16Gemm gemm, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                       const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                       int64_t ldc) {
  if (gemm == Bfloat16Gemm::OneDnn) {
    OneDnnGemm::instance().multiply_bf16(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (at::in_parallel_region()) {  // a task of the caller's: on this thread
    multiply_widened(transpose_a, transpose_b, m, n, k, a, lda, {b, nullptr, ldb}, beta, c, ldc);
    return;
  }
  if (!transpose_a && m > kRowsPerTask) {  // blocks of C's rows, one task each, all reading op(B)
    const auto widened = widen_whole(transpose_b, k, n, b, ldb);
    const RightOperand right{nullptr, widened.data(), transpose_b ? k : n};
    at::parallel_for(0, (m + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = task * kRowsPerTask, rows = std::min(kRowsPerTask, m - first);
        multiply_widened(false, transpose_b, rows, n, k, a + first * lda, lda, right, beta, c + first * ldc, ldc);
      }
    });
    return;
  }
  // A long sum (a weight's gradient: k = the rows): groups of it, one task each, each into a C of
  // its own, added in a fixed order (the result does not depend on the threads).
  const int64_t group = kSumChunk * kChunksPerGroup, groups = (k + group - 1) / group;
  if (groups == 1) {
    multiply_widened(transpose_a, transpose_b, m, n, k, a, lda, {b, nullptr, ldb}, beta, c, ldc);
    return;
  }
  std::vector<float> partial(static_cast<size_t>(groups * m * n));
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * group, length = std::min(group, k - first);
      // op(A)[:, first:] and op(B)[first:, :] as stored
      const uint16_t* a_part = transpose_a ? a + first * lda : a + first;
      const uint16_t* b_part = transpose_b ? b + first : b + first * ldb;
      multiply_widened(transpose_a, transpose_b, m, n, length, a_part, lda, {b_part, nullptr, ldb}, 0.0f,
                       partial.data() + g * m * n, n);
    }
  });
  for (int64_t r = 0; r < m; ++r) {
    float* row = c + r * ldc;
    for (int64_t col = 0; col < n; ++col) {
      float sum = 0.0f;
      for (int64_t g = 0; g < groups; ++g) sum += partial[static_cast<size_t>((g * m + r) * n + col)];
      row[col] = (beta == 0.0f ? 0.0f : beta * row[col]) + sum;
    }
  }
}

at::Tensor bfloat16_product(Bfloat16Gemm gemm, int64_t m, int64_t n, int64_t k, const Bf16Operand& a,
                            const Bf16Operand& b, const at::Tensor& bias) {
  TORCH_CHECK(!a.transposed, "qkv: bfloat16_product splits the rows of its left operand: it cannot be transposed");
  auto out = at::empty({m, n}, a.tensor.options().dtype(at::kBFloat16));
  const auto bias_values = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_row = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  const uint16_t *a_bits = bits_of(a.tensor), *b_bits = bits_of(b.tensor);
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  // On the float32 GEMM every task reads all of op(b): widened once here, not per task.
  std::vector<float> b_widened;
  if (gemm == Bfloat16Gemm::Float32) b_widened = widen_whole(b.transposed, k, n, b_bits, b.ld);
  const RightOperand right{nullptr, b_widened.data(), b.transposed ? k : n};
  // Inside a task oneDNN's GEMM sees it runs in a parallel region and stays on the task's thread.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block(static_cast<size_t>(std::min(kRowsPerTask, m) * n));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task * kRowsPerTask, rows = std::min(kRowsPerTask, m - first);
      if (bias_row) {
        for (int64_t r = 0; r < rows; ++r) std::copy(bias_row, bias_row + n, block.data() + r * n);
      }
      const float beta = bias_row ? 1.0f : 0.0f;
      if (gemm == Bfloat16Gemm::Float32) {
        multiply_widened(false, b.transposed, rows, n, k, a_bits + first * a.ld, a.ld, right, beta, block.data(), n);
      } else {
        OneDnnGemm::instance().multiply_bf16(false, b.transposed, rows, n, k, a_bits + first * a.ld, a.ld, b_bits, b.ld,
                                             beta, block.data(), n);
      }
      round_values(block.data(), out_bits + first * n, rows * n);
    }
  });
  return out;
}

at::Tensor bfloat16_column_sums(Bfloat16Gemm gemm, const at::Tensor& rows) {
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && rows.dim() == 2 && rows.is_contiguous(),
              "qkv: bfloat16_column_sums expected a contiguous bfloat16 matrix, got ", rows.scalar_type(), " ",
              rows.sizes());
  const int64_t m = rows.size(0), n = rows.size(1);
  auto sums = at::empty({n}, rows.options().dtype(at::kFloat));
  const auto ones = at::ones({m}, rows.options());
  // (1 × n) = ones (1 × m) · rows (m × n)
  multiply_bfloat16(gemm, false, false, 1, n, m, bits_of(ones), m, bits_of(rows), n, 0.0f, sums.data_ptr<float>(), n);
  return sums;
}

}  // namespace qkv::kernels::linear
