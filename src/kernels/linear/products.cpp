// The linear layers' products on qkv's micro-kernels or oneDNN's GEMM (see products.h).
#include "kernels/linear/products.h"

#include "kernels/bfloat16_bits.h"
#include "kernels/linear/onednn_gemm.h"
#include "kernels/tiled/cpu_features.h"
#include "kernels/tiled/packed_products.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

// at::parallel_for is an inline `#pragma omp parallel` in an OpenMP build of LibTorch: compiled
// without OpenMP it is a loop on one thread (src/CMakeLists.txt gives this file -fopenmp).
#if AT_PARALLEL_OPENMP && defined(QKV_OPENMP_FOUND) && !defined(_OPENMP)
#error "products.cpp calls at::parallel_for: compile it with OpenMP (src/CMakeLists.txt)"
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

// A product too small for blocks of kRowsPerTask rows (a short sequence's projections, the
// gradient of a weight from a few hundred rows) is split by C's columns instead: each task packs
// only its columns of op(B) and multiplies every row of A by them. Rows would share one packed
// op(B), which the other threads then pull out of the packing thread's cache: on 2 threads of an
// AMD EPYC Zen 5 (2026-12-04, K = 128 → N = 384) 32 rows took 33 µs split in two row blocks
// against 19 µs on one thread, and 13.5 µs split in two column blocks. A task takes whole panels of
// kColumnsPerPanel columns (the AVX-512 micro-kernels' widest) and at least as many multiply-adds
// as pay for another thread, measured there (the split against one thread, best of 7 × 20 ms):
// - A's rows as stored (a forward product, an input's gradient): 2^18. 8 rows (2^18.6 in all)
//   9.4 µs either way, 16 rows (2^19.6) 13.3 against 11.4;
// - A transposed (a weight's gradient, its sum over the rows short enough to be one group): 2^20.
//   32 rows (2^20.6) 16.6 against 20.0 µs, 48 rows (2^21.2) 24.4 against 18.1.
constexpr int64_t kColumnsPerPanel = 32;
constexpr double kFewestMultiplyAddsPerTask = 1 << 18;
constexpr double kFewestMultiplyAddsPerTransposedTask = 1 << 20;

// The columns first.. of op(B) as stored: B's columns, or (transposed) its rows.
template <typename T>
const T* columns_of(const T* b, bool transposed, int64_t ld, int64_t first) {
  return transposed ? b + first * ld : b + first;
}

// Columns of C per task for a product of m × n × k on the threads at hand (n: one task).
int64_t columns_per_task(int64_t m, int64_t n, int64_t k, bool transpose_a) {
  const auto threads = static_cast<int64_t>(std::max(1, at::get_num_threads()));
  const double fewest = transpose_a ? kFewestMultiplyAddsPerTransposedTask : kFewestMultiplyAddsPerTask;
  const auto worth = static_cast<int64_t>(static_cast<double>(m) * n * k / fewest);
  const int64_t tasks = std::clamp<int64_t>(worth, 1, threads);
  const int64_t columns = (n + tasks - 1) / tasks;
  return std::min(n, (columns + kColumnsPerPanel - 1) / kColumnsPerPanel * kColumnsPerPanel);
}

// Rows of C per task where C has more than kRowsPerTask rows: kRowsPerTask, or fewer so that every
// thread gets a share (300 rows on 2 threads: 168 and 132, not 256 and 44), in multiples of 24 rows
// (whole micro-kernel tiles: AVX-512's 8 and 12, AVX2's 6).
int64_t rows_per_task(int64_t m) {
  const auto threads = static_cast<int64_t>(std::max(1, at::get_num_threads()));
  const int64_t rows = (m + threads - 1) / threads;
  return std::min(kRowsPerTask, (rows + 23) / 24 * 24);
}

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

// The length of the sum multiplied per chunk on the float32 route where the sum is long (a
// weight's gradient): a 256-row chunk of grad and of x, widened, stay in L2 for its products.
constexpr int64_t kSumChunk = 256;

// rows × cols bfloat16 values (row stride ld) widened into a contiguous float32 block.
void widen_block(const uint16_t* from, int64_t ld, int64_t rows, int64_t cols, float* into) {
  for (int64_t r = 0; r < rows; ++r) widen_values(from + r * ld, into + r * cols, cols);
}

// Chunks of the sum per task where multiply_bfloat16 splits a long sum among the threads.
constexpr int64_t kChunksPerGroup = kRowsPerSumGroup / kSumChunk;
static_assert(kChunksPerGroup * kSumChunk == kRowsPerSumGroup, "a group of the sum is whole chunks");

using tiled::PackedRight;
using tiled::Strided;

// A stored matrix with row stride ld, or its transpose (transposed): element (r, c) of the operand.
template <typename T>
Strided<T> matrix_view(const T* values, int64_t ld, bool transposed) {
  return transposed ? Strided<T>{values, 1, ld} : Strided<T>{values, ld, 1};
}
Strided<c10::BFloat16> bfloat16_view(const uint16_t* bits, int64_t ld, bool transposed) {
  return matrix_view(reinterpret_cast<const c10::BFloat16*>(bits), ld, transposed);
}

// The right operand op(B) (k × n, bfloat16 or float32) of float32 products, made ready once and
// multiplied by any number of left operands: packed (bfloat16 widened on the way) for qkv's float32
// micro-kernels where the tiled kernel's instruction set has them in vectors (AVX2 + FMA,
// AVX-512). Elsewhere (plain C++: another architecture, or an x86 CPU without AVX2, where the
// micro-kernels ran at 5 GFLOP/s against oneDNN's 205 on AMD EPYC Zen 5) bfloat16 is widened to a
// float32 matrix for oneDNN's float32 GEMM; float32 still packs for the micro-kernels (right, if
// slow: the linear layers route float32 here only where they are vectors, linear.h).
class Float32Right {
 public:
  Float32Right() : vector_micro_kernels_(float32_products_on_micro_kernels()) {}

  void prepare(bool transposed, int64_t k, int64_t n, const float* b, int64_t ldb) {
    k_ = k, n_ = n, transposed_ = transposed, packed_for_micro_kernels_ = true;
    packed_.pack(matrix_view(b, ldb, transposed), k, n, {tiled::active_isa(), /*bf16=*/false});
  }

  void prepare(bool transposed, int64_t k, int64_t n, const uint16_t* b, int64_t ldb) {
    k_ = k, n_ = n, transposed_ = transposed, packed_for_micro_kernels_ = vector_micro_kernels_;
    if (packed_for_micro_kernels_) {
      packed_.pack(bfloat16_view(b, ldb, transposed), k, n, {tiled::active_isa(), /*bf16=*/false});
      return;
    }
    const int64_t rows = transposed ? n : k, cols = transposed ? k : n;  // as stored
    widened_.resize(static_cast<size_t>(rows * cols));
    widen_block(b, ldb, rows, cols, widened_.data());
  }

  // C (m × n, row stride ldc) = A · op(B) + beta · C, A float32 (m × k) stored by rows
  // (col_stride 1) or transposed (row_stride 1); beta 0 never reads C.
  void multiply(Strided<float> a, int64_t m, float beta, float* c, int64_t ldc) const {
    if (packed_for_micro_kernels_) {
      tiled::multiply(a, m, packed_, 1.0f, beta, c, ldc);
      return;
    }
    const bool transpose_a = a.col_stride != 1;
    OneDnnGemm::instance().multiply(transpose_a, transposed_, m, n_, k_, a.data,
                                    transpose_a ? a.col_stride : a.row_stride, widened_.data(),
                                    transposed_ ? k_ : n_, beta, c, ldc);
  }

  // The same with A's rows (row stride lda), on this thread: bfloat16 ones the micro-kernels widen
  // themselves, a block of rows at a time.
  void multiply_rows(const float* a, int64_t lda, int64_t m, float beta, float* c, int64_t ldc) const {
    multiply(matrix_view(a, lda, false), m, beta, c, ldc);
  }
  void multiply_rows(const uint16_t* a, int64_t lda, int64_t m, float beta, float* c, int64_t ldc) const {
    if (packed_for_micro_kernels_) {
      tiled::multiply(bfloat16_view(a, lda, false), m, packed_, 1.0f, beta, c, ldc);
      return;
    }
    thread_local std::vector<float> kept;
    const Scratch widened(kept, m * k_);
    widen_block(a, lda, m, k_, widened.data());
    multiply(Strided<float>{widened.data(), k_, 1}, m, beta, c, ldc);
  }

 private:
  const bool vector_micro_kernels_;        // the tiled kernel's instruction set has them in vectors
  bool packed_for_micro_kernels_ = false;  // op(B) lies in packed_ (else widened_, for oneDNN)
  int64_t k_ = 0, n_ = 0;
  bool transposed_ = false;
  PackedRight packed_;
  std::vector<float> widened_;
};

// A product's float32 products on this thread (T: float, or uint16_t for bfloat16 bits): the sum
// over k in chunks, each chunk of op(B) (chunk × n) made ready and multiplied by that chunk of
// op(A): A's rows as stored, or a transposed A's (chunk rows of m values) read through a transposed
// view, widened here first where bfloat16.
template <typename T>
void multiply_by_chunks(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda,
                        const T* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  constexpr bool widened = std::is_same_v<T, uint16_t>;
  Float32Right right;
  thread_local std::vector<float> a_kept;
  const Scratch a_scratch(a_kept, widened && transpose_a ? std::min(k, kSumChunk) * m : 0);
  for (int64_t first = 0; first < k; first += kSumChunk) {
    const int64_t chunk = std::min(kSumChunk, k - first);
    const float chunk_beta = first == 0 ? beta : 1.0f;
    // op(A)[:, first:first+chunk] and op(B)[first:first+chunk, :] as stored
    const T* a_part = transpose_a ? a + first * lda : a + first;
    const T* b_part = transpose_b ? b + first : b + first * ldb;
    right.prepare(transpose_b, chunk, n, b_part, ldb);
    if (!transpose_a) {
      right.multiply_rows(a_part, lda, m, chunk_beta, c, ldc);
    } else if constexpr (widened) {
      widen_block(a_part, lda, chunk, m, a_scratch.data());
      right.multiply(Strided<float>{a_scratch.data(), 1, m}, m, chunk_beta, c, ldc);
    } else {
      right.multiply(Strided<float>{a_part, 1, lda}, m, chunk_beta, c, ldc);
    }
  }
}

// C = op(A) · op(B) + beta · C by float32 products (T as above), spread over the threads: blocks
// of C's rows, or a long sum (a weight's gradient) in groups added in a fixed order.
template <typename T>
void multiply_on_float32_route(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const T* a,
                               int64_t lda, const T* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (at::in_parallel_region()) {  // a task of the caller's: on this thread
    multiply_by_chunks(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (!transpose_a && m > kRowsPerTask) {  // blocks of C's rows, one task each, all reading op(B)
    Float32Right right;
    right.prepare(transpose_b, k, n, b, ldb);
    const int64_t rows_each = rows_per_task(m);
    at::parallel_for(0, (m + rows_each - 1) / rows_each, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = task * rows_each, rows = std::min(rows_each, m - first);
        right.multiply_rows(a + first * lda, lda, rows, beta, c + first * ldc, ldc);
      }
    });
    return;
  }
  // A long sum (a weight's gradient: k = the rows): groups of it, one task each, each into a C of
  // its own, added in a fixed order (the result does not depend on the threads).
  const int64_t group = kSumChunk * kChunksPerGroup, groups = (k + group - 1) / group;
  if (!transpose_a || groups == 1) {  // few rows, or a short sum: blocks of C's columns
    const int64_t columns_each = columns_per_task(m, n, k, transpose_a);
    if (columns_each >= n) {
      multiply_by_chunks(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    // Each value is summed as on one thread, in the same order: the result does not depend on the threads.
    at::parallel_for(0, (n + columns_each - 1) / columns_each, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = task * columns_each, columns = std::min(columns_each, n - first);
        multiply_by_chunks(transpose_a, transpose_b, m, columns, k, a, lda, columns_of(b, transpose_b, ldb, first), ldb,
                           beta, c + first, ldc);
      }
    });
    return;
  }
  thread_local std::vector<float> partial_kept;
  const Scratch partial_scratch(partial_kept, groups * m * n);
  float* partial = partial_scratch.data();  // every group writes its m × n (beta 0)
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * group, length = std::min(group, k - first);
      // op(A)[:, first:] and op(B)[first:, :] as stored
      const T* a_part = transpose_a ? a + first * lda : a + first;
      const T* b_part = transpose_b ? b + first : b + first * ldb;
      multiply_by_chunks(transpose_a, transpose_b, m, n, length, a_part, lda, b_part, ldb, 0.0f, partial + g * m * n, n);
    }
  });
  add_groups(partial, groups, m * n, m, n, beta, c, ldc);
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

bool float32_products_on_micro_kernels() { return tiled::at_least(tiled::active_isa(), tiled::ProductIsa::Avx2); }

void multiply_bfloat16(Bfloat16Gemm gemm, bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k,
                       const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                       int64_t ldc) {
  if (gemm == Bfloat16Gemm::OneDnn) {
    OneDnnGemm::instance().multiply_bf16(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  multiply_on_float32_route(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

void multiply_float32(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  multiply_on_float32_route(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

at::Tensor bfloat16_product(Bfloat16Gemm gemm, int64_t m, int64_t n, int64_t k, const Bf16Operand& a,
                            const Bf16Operand& b, const at::Tensor& bias) {
  TORCH_CHECK(!a.transposed, "qkv: bfloat16_product splits the rows of its left operand: it cannot be transposed");
  auto out = at::empty({m, n}, a.tensor.options().dtype(at::kBFloat16));
  const auto bias_values = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_row = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  const uint16_t *a_bits = bits_of(a.tensor), *b_bits = bits_of(b.tensor);
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // On the float32 route a product of few rows is split by the output's columns, as
  // multiply_on_float32_route splits float32 ones (each task packs, widened, only its columns of
  // op(b)); each value is summed as on one thread.
  if (gemm == Bfloat16Gemm::Float32 && m <= kRowsPerTask && !at::in_parallel_region()) {
    const int64_t columns_each = columns_per_task(m, n, k, /*transpose_a=*/false);
    if (columns_each < n) {
      at::parallel_for(0, (n + columns_each - 1) / columns_each, 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> block_kept;
        const Scratch block_scratch(block_kept, m * columns_each);
        float* block = block_scratch.data();  // (m × columns), beta 0 without a bias
        Float32Right part;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t first = task * columns_each, columns = std::min(columns_each, n - first);
          part.prepare(b.transposed, k, columns, columns_of(b_bits, b.transposed, b.ld, first), b.ld);
          if (bias_row) {
            for (int64_t r = 0; r < m; ++r) std::copy(bias_row + first, bias_row + first + columns, block + r * columns);
          }
          part.multiply_rows(a_bits, a.ld, m, bias_row ? 1.0f : 0.0f, block, columns);
          for (int64_t r = 0; r < m; ++r) round_values(block + r * columns, out_bits + r * n + first, columns);
        }
      });
      return out;
    }
  }
  const int64_t tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  // On the float32 route every task reads all of op(b): packed (widened) once here, not per task.
  Float32Right right;
  if (gemm == Bfloat16Gemm::Float32) right.prepare(b.transposed, k, n, b_bits, b.ld);
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
        right.multiply_rows(a_bits + first * a.ld, a.ld, rows, beta, block, n);
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
  const uint16_t* grad_bits = bits_of(grad);
  const uint16_t* x_bits = want_weight ? bits_of(x) : nullptr;
  const int64_t group_rows = kSumChunk * kChunksPerGroup, groups = (M + group_rows - 1) / group_rows;
  if (groups == 1 && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    // One group would be one task, all three gradients on one thread: instead each is a product of
    // its own, split among the threads as multiply_on_float32_route splits it (dx by rows or
    // columns, dW by columns). dW and db are summed in the same order as in the one pass below; dx
    // too, but for 256 rows or fewer, where a sum over more than 256 outputs runs in chunks of 256.
    // (On one thread the one pass stays: it widens each block of grad once for all three.)
    if (want_x) {
      auto grad_x = at::empty({M, K}, float32);
      multiply_on_float32_route(false, weight.transposed, M, K, N, grad_bits, N, bits_of(weight.tensor), weight.ld, 0.0f,
                                grad_x.data_ptr<float>(), K);
      out.grad_x = round_grad_x ? round_to_bfloat16(grad_x) : grad_x;
    }
    if (want_weight) {  // dW (N × K) = gradᵀ · x
      out.grad_weight = at::empty({N, K}, float32);
      multiply_on_float32_route(true, false, N, K, M, grad_bits, N, x_bits, K, 0.0f,
                                out.grad_weight.data_ptr<float>(), K);
    }
    if (want_bias) {  // db = the rows of grad, added in order
      out.grad_bias = at::empty({N}, float32);
      float* grad_bias = out.grad_bias.data_ptr<float>();
      thread_local std::vector<float> row_kept;
      const Scratch row(row_kept, N);
      widen_values(grad_bits, grad_bias, N);
      for (int64_t r = 1; r < M; ++r) {
        widen_values(grad_bits + r * N, row.data(), N);
        add_into(grad_bias, row.data(), N);
      }
    }
    return out;
  }
  // dx's products read all of W (N × K): packed, widened, once.
  Float32Right w_right;
  if (want_x) w_right.prepare(weight.transposed, N, K, bits_of(weight.tensor), weight.ld);
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
  const int64_t group_stride = (want_weight ? N * K : 0) + (want_bias ? N : 0);
  thread_local std::vector<float> partial_kept;
  const Scratch partial_scratch(partial_kept, groups * group_stride);
  float* partial = partial_scratch.data();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> grad_kept, block_kept;
    const Scratch grad_block(grad_kept, kSumChunk * N), rounded_block(block_kept, round_grad_x ? kSumChunk * K : 0);
    Float32Right x_right;  // each chunk's rows of x (rows × K)
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
          w_right.multiply(Strided<float>{g_rows, N, 1}, rows, 0.0f, target, K);
          if (round_grad_x) round_values(target, grad_x_bits + first * K, rows * K);
        }
        if (want_weight) {  // dW (N × K) += g_rowsᵀ · x rows
          x_right.prepare(false, rows, K, x_bits + first * K, K);
          x_right.multiply(Strided<float>{g_rows, 1, N}, N, first_block ? 0.0f : 1.0f, grad_weight, K);
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
