// bfloat16 products rounded in cache (see bfloat16_products.h).
#include "kernels/linear/bfloat16_products.h"

#include "kernels/bfloat16_bits.h"
#include "kernels/linear/onednn_gemm.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
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

// Scratch of at least `count` floats for this thread, not zeroed: every caller writes each value
// before reading it. Zero-filled vectors made per task and call took 2% of the lm's bf16-mixed step
// on the float32 route (perf, AVX2 emulated on AMD EPYC Zen 5, 2026-12-03), so blocks up to 4 MiB
// (all of the lm's) stay with the thread for its next call; larger ones (a big model's weights or
// a weight gradient's partial sums) are freed with the Scratch, so that no thread keeps them.
constexpr int64_t kKeptScratchFloats = int64_t{1} << 20;

class Scratch {
 public:
  Scratch(std::vector<float>& kept, int64_t count) {
    if (count <= kKeptScratchFloats) {
      if (kept.size() < static_cast<size_t>(count)) kept.resize(static_cast<size_t>(count));
      data_ = kept.data();
    } else {
      own_.reset(new float[static_cast<size_t>(count)]);  // default-initialised: not zeroed
      data_ = own_.get();
    }
  }
  float* data() const { return data_; }

 private:
  std::unique_ptr<float[]> own_;
  float* data_ = nullptr;
};

// sum[i] += values[i]: the weight gradient's partial sums, added group by group.
QKV_ROUNDING_CLONES void add_into(float* __restrict sum, const float* __restrict values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) sum[i] += values[i];
}

// C (m × n, row stride ldc) = the sum of `groups` partial m × n matrices (row stride n, one every
// group_stride floats) + beta · C. C's rows among the threads; each value's partials added in group
// order into the first group's (which is overwritten), whichever thread adds them.
void add_groups(float* partial, int64_t groups, int64_t group_stride, int64_t m, int64_t n, float beta, float* c,
                int64_t ldc) {
  at::parallel_for(0, m, std::max<int64_t>(1, kRoundingGrain / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* sum = partial + r * n;
      for (int64_t g = 1; g < groups; ++g) add_into(sum, partial + g * group_stride + r * n, n);
      float* row = c + r * ldc;
      if (beta == 0.0f) {
        std::copy(sum, sum + n, row);
      } else {
        for (int64_t col = 0; col < n; ++col) row[col] = beta * row[col] + sum[col];
      }
    }
  });
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
constexpr int64_t kChunksPerGroup = kRowsPerSumGroup / kSumChunk;
static_assert(kChunksPerGroup * kSumChunk == kRowsPerSumGroup, "a group of the sum is whole chunks");

// op(B) for multiply_widened: its bfloat16 bits (row stride ld, widened chunk by chunk), or, where
// every block of C's rows reads all of it, widened once beforehand (widen_whole; ld its row stride).
struct RightOperand {
  const uint16_t* bits = nullptr;
  const float* widened = nullptr;
  int64_t ld = 0;
};

// op(B) as stored (k × n, or n × k transposed), widened to a contiguous float32 matrix in the
// calling thread's scratch (read by every task of the call).
Scratch widen_whole(bool transposed, int64_t k, int64_t n, const uint16_t* b, int64_t ldb) {
  thread_local std::vector<float> kept;
  const int64_t rows = transposed ? n : k, cols = transposed ? k : n;
  Scratch widened(kept, rows * cols);
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
  thread_local std::vector<float> a_kept, b_kept;
  const Scratch a_scratch(a_kept, m * chunk_size), b_scratch(b_kept, b.widened ? 0 : chunk_size * n);
  float *a_chunk = a_scratch.data(), *b_chunk = b_scratch.data();
  for (int64_t first = 0; first < k; first += kSumChunk) {
    const int64_t chunk = std::min(kSumChunk, k - first);
    // op(A)[:, first:first+chunk]: rows of Aᵀ's storage (chunk × m), or a column block (m × chunk)
    const int64_t a_ld = transpose_a ? m : chunk;
    if (transpose_a) {
      widen_block(a + first * lda, lda, chunk, m, a_chunk);
    } else {
      widen_block(a + first, lda, m, chunk, a_chunk);
    }
    // op(B)[first:first+chunk, :]: a column block of Bᵀ's storage (n × chunk), or rows (chunk × n)
    const float* b_part = nullptr;
    int64_t b_ld = b.ld;
    if (b.widened) {
      b_part = transpose_b ? b.widened + first : b.widened + first * b.ld;
    } else {
      b_ld = transpose_b ? chunk : n;
      if (transpose_b) {
        widen_block(b.bits + first, b.ld, n, chunk, b_chunk);
      } else {
        widen_block(b.bits + first * b.ld, b.ld, chunk, n, b_chunk);
      }
      b_part = b_chunk;
    }
    onednn.multiply(transpose_a, transpose_b, m, n, chunk, a_chunk, a_ld, b_part, b_ld,
                    first == 0 ? beta : 1.0f, c, ldc);
  }
}

}  // namespace

QKV_ROUNDING_CLONES void round_values(const float* __restrict from, uint16_t* __restrict into, int64_t count) {
  for (int64_t i = 0; i < count; ++i) into[i] = float_to_bfloat16_bits(from[i]);
}

QKV_ROUNDING_CLONES void widen_values(const uint16_t* __restrict from, float* __restrict into, int64_t count) {
  for (int64_t i = 0; i < count; ++i) into[i] = bfloat16_bits_to_float(from[i]);
}

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
  thread_local std::vector<float> partial_kept;
  const Scratch partial_scratch(partial_kept, groups * m * n);
  float* partial = partial_scratch.data();  // every group writes its m × n (beta 0)
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * group, length = std::min(group, k - first);
      // op(A)[:, first:] and op(B)[first:, :] as stored
      const uint16_t* a_part = transpose_a ? a + first * lda : a + first;
      const uint16_t* b_part = transpose_b ? b + first : b + first * ldb;
      multiply_widened(transpose_a, transpose_b, m, n, length, a_part, lda, {b_part, nullptr, ldb}, 0.0f,
                       partial + g * m * n, n);
    }
  });
  add_groups(partial, groups, m * n, m, n, beta, c, ldc);
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
  std::vector<float> no_scratch;
  const Scratch b_widened = gemm == Bfloat16Gemm::Float32 ? widen_whole(b.transposed, k, n, b_bits, b.ld)
                                                          : Scratch(no_scratch, 0);
  const RightOperand right{nullptr, b_widened.data(), b.transposed ? k : n};
  // Inside a task oneDNN's GEMM sees it runs in a parallel region and stays on the task's thread.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> block_kept;
    const Scratch block_scratch(block_kept, std::min(kRowsPerTask, m) * n);
    float* block = block_scratch.data();  // beta 0 without a bias
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task * kRowsPerTask, rows = std::min(kRowsPerTask, m - first);
      if (bias_row) {
        for (int64_t r = 0; r < rows; ++r) std::copy(bias_row, bias_row + n, block + r * n);
      }
      const float beta = bias_row ? 1.0f : 0.0f;
      if (gemm == Bfloat16Gemm::Float32) {
        multiply_widened(false, b.transposed, rows, n, k, a_bits + first * a.ld, a.ld, right, beta, block, n);
      } else {
        OneDnnGemm::instance().multiply_bf16(false, b.transposed, rows, n, k, a_bits + first * a.ld, a.ld, b_bits, b.ld,
                                             beta, block, n);
      }
      round_values(block, out_bits + first * n, rows * n);
    }
  });
  return out;
}

LinearGradients linear_gradients_widened(const at::Tensor& grad, const at::Tensor& x, const Bf16Operand& weight,
                                         bool want_x, bool round_grad_x, bool want_weight, bool want_bias) {
  // W's logical shape is (N × K) whichever way it is stored.
  const int64_t M = grad.size(0), N = grad.size(1), K = weight.tensor.size(1);
  TORCH_CHECK(grad.scalar_type() == at::kBFloat16 && grad.dim() == 2 && grad.is_contiguous() &&
                  weight.tensor.scalar_type() == at::kBFloat16 && weight.tensor.size(0) == N &&
                  (!want_weight || (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() &&
                                    x.size(0) == M && x.size(1) == K)),
              "qkv: linear_gradients_widened expected contiguous bfloat16 grad (M × N), x (M × K) and W (N × K), "
              "got grad ", grad.scalar_type(), " ", grad.sizes(), ", x ", x.scalar_type(), " ", x.sizes(), ", W ",
              weight.tensor.scalar_type(), " ", weight.tensor.sizes());
  const auto float32 = grad.options().dtype(at::kFloat);
  LinearGradients out;
  if (M == 0) return out;  // the callers route no empty product here
  const auto& onednn = OneDnnGemm::instance();
  const uint16_t* grad_bits = bits_of(grad);
  const uint16_t* x_bits = want_weight ? bits_of(x) : nullptr;
  // dx's products read all of W: widened once.
  std::vector<float> no_scratch;
  const Scratch w_widened = want_x ? widen_whole(weight.transposed, N, K, bits_of(weight.tensor), weight.ld)
                                   : Scratch(no_scratch, 0);
  const int64_t w_ld = weight.transposed ? N : K;
  float* grad_x_values = nullptr;
  uint16_t* grad_x_bits = nullptr;
  if (want_x) {
    out.grad_x = at::empty({M, K}, round_grad_x ? grad.options() : float32);
    if (round_grad_x) {
      grad_x_bits = reinterpret_cast<uint16_t*>(out.grad_x.data_ptr<at::BFloat16>());
    } else {
      grad_x_values = out.grad_x.data_ptr<float>();
    }
  }
  // Each group's partial dW (N × K) and db (N), side by side.
  const int64_t group_rows = kSumChunk * kChunksPerGroup, groups = (M + group_rows - 1) / group_rows;
  const int64_t group_stride = (want_weight ? N * K : 0) + (want_bias ? N : 0);
  thread_local std::vector<float> partial_kept;
  const Scratch partial_scratch(partial_kept, groups * group_stride);
  float* partial = partial_scratch.data();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> grad_kept, x_kept, block_kept;
    const Scratch grad_block(grad_kept, kSumChunk * N), x_block(x_kept, want_weight ? kSumChunk * K : 0),
        rounded_block(block_kept, round_grad_x ? kSumChunk * K : 0);
    for (int64_t g = begin; g < end; ++g) {
      float* grad_weight = partial + g * group_stride;
      float* grad_bias = grad_weight + (want_weight ? N * K : 0);
      const int64_t group_first = g * group_rows, group_end = std::min(M, group_first + group_rows);
      for (int64_t first = group_first; first < group_end; first += kSumChunk) {
        const int64_t rows = std::min(kSumChunk, group_end - first);
        const bool first_block = first == group_first;
        float* g_rows = grad_block.data();  // (rows × N)
        widen_values(grad_bits + first * N, g_rows, rows * N);
        if (want_x) {  // dx rows (rows × K) = g_rows · W
          float* target = round_grad_x ? rounded_block.data() : grad_x_values + first * K;
          onednn.multiply(false, weight.transposed, rows, K, N, g_rows, N, w_widened.data(), w_ld, 0.0f, target, K);
          if (round_grad_x) round_values(target, grad_x_bits + first * K, rows * K);
        }
        if (want_weight) {  // dW (N × K) += g_rowsᵀ · x rows
          widen_values(x_bits + first * K, x_block.data(), rows * K);
          onednn.multiply(true, false, N, K, rows, g_rows, N, x_block.data(), K, first_block ? 0.0f : 1.0f,
                          grad_weight, K);
        }
        if (want_bias) {  // db += the rows of g_rows, in order (the group's first row starts it)
          if (first_block) std::copy(g_rows, g_rows + N, grad_bias);
          for (int64_t r = first_block ? 1 : 0; r < rows; ++r) add_into(grad_bias, g_rows + r * N, N);
        }
      }
    }
  });
  if (want_weight) {
    out.grad_weight = at::empty({N, K}, float32);
    add_groups(partial, groups, group_stride, N, K, 0.0f, out.grad_weight.data_ptr<float>(), K);
  }
  if (want_bias) {
    out.grad_bias = at::empty({N}, float32);
    add_groups(partial + (want_weight ? N * K : 0), groups, group_stride, 1, N, 0.0f, out.grad_bias.data_ptr<float>(),
               N);
  }
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
