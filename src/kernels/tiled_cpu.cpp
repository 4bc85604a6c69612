// The tiled backend: qkv's own fused attention for CPU tensors, in the manner of FlashAttention-2.
//
// Forward: each task takes a block of query rows of one head and streams the key/value blocks
// past it, keeping a running row maximum m and sum l (the online softmax), so the (N, S) scores
// never exist beyond one block; it saves the rows' log-sum-exp L = m + log l. Backward: each task
// owns one key/value head (and so the dK, dV of all its keys and the dQ of the query heads that
// share it); for every key block it recomputes the probabilities P = exp(S - L) block by block
// from the saved L and accumulates dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K with
// dS = P ⊙ (dO Vᵀ - rowsum(dO ⊙ O)). Both directions run at::parallel_for over their tasks with
// per-thread scratch and no atomics. Block products go through BLAS (sgemm/dgemm, single-threaded
// inside each task); bfloat16 blocks are converted to float32 first and accumulate in float32.
//
// Masks: causal blocks above the diagonal and key blocks past a sequence's key length are skipped,
// not computed; general bool / float masks are applied element by element. A row with no key left
// gets output 0, L = +inf, and so zero gradients. Dropout is drawn from a counter-based generator
// (Philox4x32-10) keyed by a seed taken from LibTorch's CPU generator and counted by (head, row,
// column), so the backward regenerates the forward's mask without storing it.
//
// B = batch, H = query heads, Hkv = key/value heads, G = H / Hkv, N = query rows, S = keys,
// D = head width, Dv = value width, Br / Bc = rows / keys per block.
#include "kernels/tiled_cpu.h"
#include "kernels/kernels.h"
#include "kernels/vector_math.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/torch.h>

#if defined(QKV_HAVE_CBLAS)
#include <cblas.h>
#endif
#if defined(QKV_HAVE_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace qkv::kernels {
namespace {

// Measured on the 2-core development machine (B=8 H=8 N=512 D=32 forward+backward and B=1 H=8
// N=4096 D=64 forward, float32, Br in {32, 64, 128} × Bc in {64, ..., 512}): 64 × 256 was fastest.
constexpr int64_t kRowsPerBlock = 64;   // Br
constexpr int64_t kKeysPerBlock = 256;  // Bc

// ---- Dropout: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") ----

struct Philox {
  uint32_t key0, key1;

  // Four 32-bit random words for the counter (c0, c1, c2, c3).
  void generate(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t out[4]) const {
    uint32_t k0 = key0, k1 = key1;
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
      const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
      const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
      c0 = hi1 ^ c1 ^ k0;
      c1 = lo1;
      c2 = hi0 ^ c3 ^ k1;
      c3 = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
  }
};

// Which (row, key) pairs of one head dropout keeps: Philox4x32 of (row, head) gives each row a key,
// and a vectorised 32-bit hash of (row key, key position) decides each pair (vector_math.h) — a
// pure function of the seed and the position, so the backward regenerates the forward's mask.
class DropoutStream {
 public:
  DropoutStream(uint64_t seed, double p)
      : philox_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)},
        threshold_(static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0))),
        scale_(p > 0 ? 1.0 / (1.0 - p) : 1.0), active_(p > 0) {}

  bool active() const { return active_; }
  double scale() const { return scale_; }

  // keep[c] for keys j0 .. j0 + count - 1 of `row` of head `head`.
  void keep(int64_t head, int64_t row, int64_t j0, int64_t count, uint8_t* keep) const {
    uint32_t words[4];
    philox_.generate(static_cast<uint32_t>(row), static_cast<uint32_t>(row >> 32), static_cast<uint32_t>(head),
                     static_cast<uint32_t>(head >> 32), words);
    dropout_keep(words[0], static_cast<uint32_t>(j0), count, threshold_, keep);
  }

 private:
  Philox philox_;
  uint32_t threshold_;  // a hash below it drops the pair: probability p
  double scale_;
  bool active_;
};

// ---- Block products: C = alpha · op(A) · op(B) + beta · C, row-major ----

template <typename T>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#if defined(QKV_HAVE_CBLAS)
  const auto ta = transpose_a ? CblasTrans : CblasNoTrans, tb = transpose_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }
#else
  // Without a CBLAS at build time: plain loops (correct, slow; Auto then prefers other backends).
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      T sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const T x = transpose_a ? a[p * lda + i] : a[i * lda + p];
        const T y = transpose_b ? b[j * ldb + p] : b[p * ldb + j];
        sum += x * y;
      }
      c[i * ldc + j] = alpha * sum + (beta == T(0) ? T(0) : beta * c[i * ldc + j]);
    }
  }
#endif
}

// Each task of at::parallel_for calls BLAS on its own small blocks. OpenBLAS's OpenMP build would
// open a parallel region of its own inside every task (nested parallelism is on by default in
// libgomp), so that 2 workers on 2 cores ran 2 × 2 threads and were slower than 1. For the
// duration of a task its thread asks OpenMP for 1 thread; the setting is restored after.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() {
#if defined(QKV_HAVE_OPENMP)
    saved_ = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
  }
  ~SingleThreadedBlas() {
#if defined(QKV_HAVE_OPENMP)
    omp_set_num_threads(saved_);
#endif
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_ = 1;
};

// ---- The operands of one call, as raw pointers and strides ----

// A 4-D tensor (B, H, rows, columns) with unit stride in its last dimension.
template <typename T>
struct Matrix4 {
  const T* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 0;
  const T* rows(int64_t b, int64_t h, int64_t row) const {
    return data + b * stride_b + h * stride_h + row * stride_row;
  }
};

template <typename T>
Matrix4<T> view_of(const torch::Tensor& t) {
  return {t.template data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2)};
}

// The general mask, broadcast to (B, H, N, S) by strides (0 where it broadcasts).
template <typename acc_t>
struct MaskView {
  const bool* bools = nullptr;
  const acc_t* values = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 0, stride_key = 0;
  bool defined() const { return bools != nullptr || values != nullptr; }
};

template <typename acc_t>
struct Problem {
  int64_t B = 0, H = 0, Hkv = 0, N = 0, S = 0, D = 0, Dv = 0;
  acc_t scale = 1;
  bool causal = false;
  const int64_t* key_lengths = nullptr;  // (B,) or null
  MaskView<acc_t> mask;
  DropoutStream dropout{0, 0.0};

  int64_t groups() const { return H / Hkv; }
  // Keys that can matter to rows [i0, i1) of batch b: past the length and above the diagonal, none.
  int64_t key_limit(int64_t b, int64_t i1) const {
    int64_t limit = S;
    if (key_lengths != nullptr) limit = std::min(limit, std::max<int64_t>(key_lengths[b], 0));
    if (causal) limit = std::min(limit, i1);
    return limit;
  }
  // Scores of rows [i0, i0 + rows) and keys [j0, j0 + cols) after the masks: -inf where masked.
  void apply_masks(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols, acc_t* scores,
                   int64_t ld) const {
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    const int64_t length = key_lengths != nullptr ? key_lengths[b] : S;
    const bool partial_length = j0 + cols > length;
    const bool partial_causal = causal && j0 + cols - 1 > i0;
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* row = scores + r * ld;
      const int64_t i = i0 + r;
      if (mask.defined()) {
        const int64_t base = b * mask.stride_b + h * mask.stride_h + i * mask.stride_row;
        if (mask.bools != nullptr) {
          for (int64_t c = 0; c < cols; ++c) {
            if (!mask.bools[base + (j0 + c) * mask.stride_key]) row[c] = kNegInf;
          }
        } else {
          for (int64_t c = 0; c < cols; ++c) row[c] += mask.values[base + (j0 + c) * mask.stride_key];
        }
      }
      if (partial_length) {
        for (int64_t c = std::max<int64_t>(0, length - j0); c < cols; ++c) row[c] = kNegInf;
      }
      if (partial_causal) {
        for (int64_t c = std::max<int64_t>(0, i + 1 - j0); c < cols; ++c) row[c] = kNegInf;
      }
    }
  }
};

// Rows of a block in the accumulation type: pointers into the tensor when it already is that type,
// else converted into `scratch` (bfloat16 -> float32).
template <typename scalar_t, typename acc_t>
const acc_t* rows_as(const scalar_t* source, int64_t stride, int64_t rows, int64_t width, std::vector<acc_t>& scratch,
                     int64_t& ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    ld = stride;
    return source;
  } else {
    scratch.resize(static_cast<size_t>(rows * width));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < width; ++c) scratch[r * width + c] = static_cast<acc_t>(source[r * stride + c]);
    }
    ld = width;
    return scratch.data();
  }
}

// Tasks per chunk of at::parallel_for: 1, unless the tasks are so small (decoding one position:
// one row against the cache) that starting the threads would cost more than the arithmetic; then
// enough of them to make about 1 MFLOP per chunk, which keeps a decoded token's attention on the
// calling thread.
template <typename acc_t>
int64_t tasks_per_chunk(const Problem<acc_t>& p, int64_t rows_per_task) {
  constexpr double kFlopsPerChunk = 1e6;
  const double flops = 4.0 * static_cast<double>(rows_per_task) * static_cast<double>(p.S) *
                       static_cast<double>(std::max(p.D, p.Dv));
  return std::max<int64_t>(1, static_cast<int64_t>(kFlopsPerChunk / std::max(flops, 1.0)));
}

// ---- Forward ----

template <typename scalar_t, typename acc_t>
void forward_blocks(const Problem<acc_t>& p, const Matrix4<scalar_t>& q, const Matrix4<scalar_t>& k,
                    const Matrix4<scalar_t>& v, scalar_t* out, acc_t* lse) {
  const int64_t row_blocks = (p.N + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t tasks = p.B * p.H * row_blocks;
  at::parallel_for(0, tasks, tasks_per_chunk(p, std::min(p.N, kRowsPerBlock)), [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas single_threaded;
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    std::vector<acc_t> scores(kRowsPerBlock * kKeysPerBlock), accumulator, row_max(kRowsPerBlock),
        row_sum(kRowsPerBlock), q_scratch, k_scratch, v_scratch;
    std::vector<uint8_t> keep(kKeysPerBlock);
    accumulator.resize(static_cast<size_t>(kRowsPerBlock * p.Dv));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % row_blocks, bh = task / row_blocks, h = bh % p.H, b = bh / p.H;
      const int64_t kv_head = h / p.groups();
      const int64_t i0 = block * kRowsPerBlock, rows = std::min(kRowsPerBlock, p.N - i0);
      int64_t ldq = 0;
      const acc_t* q_rows = rows_as<scalar_t, acc_t>(q.rows(b, h, i0), q.stride_row, rows, p.D, q_scratch, ldq);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), acc_t(0));
      std::fill(accumulator.begin(), accumulator.end(), acc_t(0));
      const int64_t key_end = p.key_limit(b, i0 + rows);
      for (int64_t j0 = 0; j0 < key_end; j0 += kKeysPerBlock) {
        const int64_t cols = std::min(kKeysPerBlock, key_end - j0);
        int64_t ldk = 0, ldv = 0;
        const acc_t* k_rows = rows_as<scalar_t, acc_t>(k.rows(b, kv_head, j0), k.stride_row, cols, p.D, k_scratch, ldk);
        const acc_t* v_rows =
            rows_as<scalar_t, acc_t>(v.rows(b, kv_head, j0), v.stride_row, cols, p.Dv, v_scratch, ldv);
        // Steps 1 and 2: scaled scores of the block.
        gemm<acc_t>(false, true, rows, cols, p.D, p.scale, q_rows, ldq, k_rows, ldk, acc_t(0), scores.data(), cols);
        p.apply_masks(b, h, i0, rows, j0, cols, scores.data(), cols);
        // Step 3, online: rescale what was accumulated to the new row maximum, add this block.
        for (int64_t r = 0; r < rows; ++r) {
          acc_t* row = scores.data() + r * cols;
          const acc_t new_max = nan_max(row_max[r], max_of(row, cols));
          if (new_max == kNegInf) {  // nothing attended yet in this row
            std::fill(row, row + cols, acc_t(0));
            continue;
          }
          const acc_t correction = std::exp(row_max[r] - new_max);  // exp(-inf) = 0 on the first block
          const acc_t sum = exp_shifted_sum(row, cols, new_max);
          row_sum[r] = row_sum[r] * correction + sum;
          row_max[r] = new_max;
          if (correction != acc_t(1)) scale(accumulator.data() + r * p.Dv, p.Dv, correction);
          if (p.dropout.active()) {
            p.dropout.keep(b * p.H + h, i0 + r, j0, cols, keep.data());
            const acc_t kept = static_cast<acc_t>(p.dropout.scale());
            for (int64_t c = 0; c < cols; ++c) row[c] = keep[c] ? row[c] * kept : acc_t(0);
          }
        }
        // Step 4: the block's weighted values.
        gemm<acc_t>(false, false, rows, p.Dv, cols, acc_t(1), scores.data(), cols, v_rows, ldv, acc_t(1),
                    accumulator.data(), p.Dv);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        scalar_t* out_row = out + ((b * p.H + h) * p.N + i) * p.Dv;
        const bool dead = row_sum[r] == acc_t(0);
        const acc_t inverse = dead ? acc_t(0) : acc_t(1) / row_sum[r];
        for (int64_t d = 0; d < p.Dv; ++d) out_row[d] = static_cast<scalar_t>(accumulator[r * p.Dv + d] * inverse);
        lse[(b * p.H + h) * p.N + i] =
            dead ? std::numeric_limits<acc_t>::infinity() : row_max[r] + std::log(row_sum[r]);
      }
    }
  });
}

// ---- Backward ----

template <typename scalar_t, typename acc_t>
void backward_blocks(const Problem<acc_t>& p, const Matrix4<scalar_t>& q, const Matrix4<scalar_t>& k,
                     const Matrix4<scalar_t>& v, const scalar_t* out, const scalar_t* grad_out, const acc_t* lse,
                     scalar_t* grad_q, scalar_t* grad_k, scalar_t* grad_v) {
  const int64_t G = p.groups();
  at::parallel_for(0, p.B * p.Hkv, tasks_per_chunk(p, p.groups() * p.N), [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas single_threaded;
    std::vector<acc_t> probabilities(kRowsPerBlock * kKeysPerBlock), grad_probabilities(kRowsPerBlock * kKeysPerBlock),
        dropped(kRowsPerBlock * kKeysPerBlock), grad_k_block, grad_v_block, grad_q_all, delta, q_scratch, k_scratch,
        v_scratch, o_scratch;
    std::vector<uint8_t> keep(kKeysPerBlock);
    grad_k_block.resize(static_cast<size_t>(kKeysPerBlock * p.D));
    grad_v_block.resize(static_cast<size_t>(kKeysPerBlock * p.Dv));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv_head = task % p.Hkv, b = task / p.Hkv;
      // D_i = rowsum(dO ⊙ O) of every row of the G query heads, and their dQ accumulators.
      delta.assign(static_cast<size_t>(G * p.N), acc_t(0));
      grad_q_all.assign(static_cast<size_t>(G * p.N * p.D), acc_t(0));
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kv_head * G + g;
        for (int64_t i = 0; i < p.N; ++i) {
          const scalar_t* o_row = out + ((b * p.H + h) * p.N + i) * p.Dv;
          const scalar_t* go_row = grad_out + ((b * p.H + h) * p.N + i) * p.Dv;
          acc_t sum = 0;
          for (int64_t d = 0; d < p.Dv; ++d) sum += static_cast<acc_t>(o_row[d]) * static_cast<acc_t>(go_row[d]);
          delta[g * p.N + i] = sum;
        }
      }
      const int64_t key_end = p.key_limit(b, p.N);
      for (int64_t j0 = 0; j0 < p.S; j0 += kKeysPerBlock) {
        const int64_t cols = std::min(kKeysPerBlock, p.S - j0);
        scalar_t* gk = grad_k + ((b * p.Hkv + kv_head) * p.S + j0) * p.D;
        scalar_t* gv = grad_v + ((b * p.Hkv + kv_head) * p.S + j0) * p.Dv;
        if (j0 >= key_end) {  // keys no row attends to: zero gradients
          std::fill(gk, gk + cols * p.D, scalar_t(0));
          std::fill(gv, gv + cols * p.Dv, scalar_t(0));
          continue;
        }
        int64_t ldk = 0, ldv = 0;
        const acc_t* k_rows = rows_as<scalar_t, acc_t>(k.rows(b, kv_head, j0), k.stride_row, cols, p.D, k_scratch, ldk);
        const acc_t* v_rows =
            rows_as<scalar_t, acc_t>(v.rows(b, kv_head, j0), v.stride_row, cols, p.Dv, v_scratch, ldv);
        std::fill(grad_k_block.begin(), grad_k_block.end(), acc_t(0));
        std::fill(grad_v_block.begin(), grad_v_block.end(), acc_t(0));
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kv_head * G + g;
          // Causal: rows above the block's first key never see it.
          const int64_t first_row = p.causal ? (j0 / kRowsPerBlock) * kRowsPerBlock : 0;
          for (int64_t i0 = first_row; i0 < p.N; i0 += kRowsPerBlock) {
            const int64_t rows = std::min(kRowsPerBlock, p.N - i0);
            int64_t ldq = 0, ldo = 0;
            const acc_t* q_rows = rows_as<scalar_t, acc_t>(q.rows(b, h, i0), q.stride_row, rows, p.D, q_scratch, ldq);
            const acc_t* go_rows = rows_as<scalar_t, acc_t>(grad_out + ((b * p.H + h) * p.N + i0) * p.Dv, p.Dv, rows,
                                                            p.Dv, o_scratch, ldo);
            // P = exp(S - L): the forward's probabilities, recomputed.
            gemm<acc_t>(false, true, rows, cols, p.D, p.scale, q_rows, ldq, k_rows, ldk, acc_t(0), probabilities.data(),
                        cols);
            p.apply_masks(b, h, i0, rows, j0, cols, probabilities.data(), cols);
            for (int64_t r = 0; r < rows; ++r) {
              const acc_t row_lse = lse[(b * p.H + h) * p.N + i0 + r];
              acc_t* row = probabilities.data() + r * cols;
              if (row_lse == std::numeric_limits<acc_t>::infinity()) {  // a row with no key: P = 0
                std::fill(row, row + cols, acc_t(0));
              } else {
                exp_shifted_sum(row, cols, row_lse);
              }
            }
            // dP = dO Vᵀ
            gemm<acc_t>(false, true, rows, cols, p.Dv, acc_t(1), go_rows, ldo, v_rows, ldv, acc_t(0),
                        grad_probabilities.data(), cols);
            // The forward multiplied P by Z / (1 - p) (Z: the kept pairs): V's gradient takes that
            // product, and dP the same factor.
            const acc_t* value_weights = probabilities.data();
            if (p.dropout.active()) {
              const acc_t kept = static_cast<acc_t>(p.dropout.scale());
              for (int64_t r = 0; r < rows; ++r) {
                p.dropout.keep(b * p.H + h, i0 + r, j0, cols, keep.data());
                const acc_t* row_p = probabilities.data() + r * cols;
                acc_t* row_dropped = dropped.data() + r * cols;
                acc_t* row_dp = grad_probabilities.data() + r * cols;
                for (int64_t c = 0; c < cols; ++c) {
                  row_dropped[c] = keep[c] ? row_p[c] * kept : acc_t(0);
                  row_dp[c] = keep[c] ? row_dp[c] * kept : acc_t(0);
                }
              }
              value_weights = dropped.data();
            }
            // dV += (P ⊙ Z / (1 - p))ᵀ dO
            gemm<acc_t>(true, false, cols, p.Dv, rows, acc_t(1), value_weights, cols, go_rows, ldo, acc_t(1),
                        grad_v_block.data(), p.Dv);
            // dS = P ⊙ (dP - D_i), in place of dP.
            for (int64_t r = 0; r < rows; ++r) {
              softmax_backward(probabilities.data() + r * cols, grad_probabilities.data() + r * cols, cols,
                               delta[g * p.N + i0 + r]);
            }
            // dK += scale · dSᵀ Q; dQ += scale · dS K
            gemm<acc_t>(true, false, cols, p.D, rows, p.scale, grad_probabilities.data(), cols, q_rows, ldq, acc_t(1),
                        grad_k_block.data(), p.D);
            gemm<acc_t>(false, false, rows, p.D, cols, p.scale, grad_probabilities.data(), cols, k_rows, ldk, acc_t(1),
                        grad_q_all.data() + (g * p.N + i0) * p.D, p.D);
          }
        }
        for (int64_t n = 0; n < cols * p.D; ++n) gk[n] = static_cast<scalar_t>(grad_k_block[n]);
        for (int64_t n = 0; n < cols * p.Dv; ++n) gv[n] = static_cast<scalar_t>(grad_v_block[n]);
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kv_head * G + g;
        scalar_t* gq = grad_q + (b * p.H + h) * p.N * p.D;
        const acc_t* source = grad_q_all.data() + g * p.N * p.D;
        for (int64_t n = 0; n < p.N * p.D; ++n) gq[n] = static_cast<scalar_t>(source[n]);
      }
    }
  });
}

// ---- The operation, as LibTorch sees it ----

// q, k, v and the mask as (B, H, N, D) / (B, Hkv, S, D) / (B, H, N, S) views: the functional core
// accepts (..., N, D) of any rank.
struct Shaped {
  torch::Tensor q, k, v, mask;
  std::vector<int64_t> output_shape;  // q's shape with Dv last
};

torch::Tensor unit_stride(const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

Shaped to_four_dims(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask,
                    bool grouped) {
  Shaped s;
  s.output_shape = q.sizes().vec();
  s.output_shape.back() = v.size(-1);
  auto scores_shape = q.sizes().vec();
  scores_shape.back() = k.size(-2);
  auto as_four = [&](const torch::Tensor& t) -> torch::Tensor {
    switch (t.dim()) {
      case 2:
        return t.unsqueeze(0).unsqueeze(0);
      case 3:
        return grouped ? t.unsqueeze(0) : t.unsqueeze(1);
      case 4:
        return t;
      default: {
        std::vector<int64_t> shape{-1, t.size(-3), t.size(-2), t.size(-1)};
        return t.reshape(shape);
      }
    }
  };
  s.q = unit_stride(as_four(q));
  s.k = unit_stride(as_four(k));
  s.v = unit_stride(as_four(v));
  if (mask.defined()) s.mask = as_four(mask.expand(scores_shape));
  return s;
}

template <typename acc_t>
Problem<acc_t> problem_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& mask, const torch::Tensor& key_lengths, double scale, bool causal,
                          double dropout, uint64_t seed) {
  Problem<acc_t> p;
  p.B = q.size(0), p.H = q.size(1), p.Hkv = k.size(1), p.N = q.size(2), p.S = k.size(2), p.D = q.size(3);
  p.Dv = v.size(3);
  p.scale = static_cast<acc_t>(scale);
  p.causal = causal;
  // Absent masks come as empty tensors: autograd::Function takes no undefined tensor arguments.
  p.key_lengths = key_lengths.numel() > 0 ? key_lengths.data_ptr<int64_t>() : nullptr;
  if (mask.dim() == 4) {
    p.mask.stride_b = mask.stride(0), p.mask.stride_h = mask.stride(1);
    p.mask.stride_row = mask.stride(2), p.mask.stride_key = mask.stride(3);
    if (mask.scalar_type() == torch::kBool) {
      p.mask.bools = mask.data_ptr<bool>();
    } else {
      p.mask.values = mask.template data_ptr<acc_t>();
    }
  }
  p.dropout = DropoutStream(seed, dropout);
  return p;
}

// What the forward keeps for the backward besides the tensors.
struct Settings {
  double scale = 1.0, dropout = 0.0;
  bool causal = false;
  uint64_t seed = 0;
};

template <typename scalar_t, typename acc_t>
std::pair<torch::Tensor, torch::Tensor> run_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                    const torch::Tensor& v, const torch::Tensor& mask,
                                                    const torch::Tensor& key_lengths, const Settings& settings) {
  const auto p =
      problem_of<acc_t>(q, k, v, mask, key_lengths, settings.scale, settings.causal, settings.dropout, settings.seed);
  auto out = torch::empty({p.B, p.H, p.N, p.Dv}, q.options());
  auto lse = torch::empty({p.B, p.H, p.N}, q.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  forward_blocks<scalar_t, acc_t>(p, view_of<scalar_t>(q), view_of<scalar_t>(k), view_of<scalar_t>(v),
                                  out.template data_ptr<scalar_t>(), lse.template data_ptr<acc_t>());
  return {out, lse};
}

template <typename scalar_t, typename acc_t>
std::vector<torch::Tensor> run_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& mask, const torch::Tensor& key_lengths,
                                        const torch::Tensor& out, const torch::Tensor& lse,
                                        const torch::Tensor& grad_out, const Settings& settings) {
  const auto p =
      problem_of<acc_t>(q, k, v, mask, key_lengths, settings.scale, settings.causal, settings.dropout, settings.seed);
  auto grad_q = torch::empty({p.B, p.H, p.N, p.D}, q.options());
  auto grad_k = torch::empty({p.B, p.Hkv, p.S, p.D}, k.options());
  auto grad_v = torch::empty({p.B, p.Hkv, p.S, p.Dv}, v.options());
  const auto grad = grad_out.contiguous();
  backward_blocks<scalar_t, acc_t>(p, view_of<scalar_t>(q), view_of<scalar_t>(k), view_of<scalar_t>(v),
                                   out.template data_ptr<scalar_t>(), grad.template data_ptr<scalar_t>(),
                                   lse.template data_ptr<acc_t>(), grad_q.template data_ptr<scalar_t>(),
                                   grad_k.template data_ptr<scalar_t>(), grad_v.template data_ptr<scalar_t>());
  return {grad_q, grad_k, grad_v};
}

Settings settings_of(torch::autograd::AutogradContext* ctx) {
  Settings s;
  s.scale = ctx->saved_data["scale"].toDouble();
  s.dropout = ctx->saved_data["dropout"].toDouble();
  s.causal = ctx->saved_data["causal"].toBool();
  s.seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
  return s;
}

class TiledAttentionFunction : public torch::autograd::Function<TiledAttentionFunction> {
 public:
  // q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), mask (B, H, N, S) view or empty,
  // key_lengths (B,) int64 or empty. Returns the output (B, H, N, Dv).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& mask, const torch::Tensor& key_lengths,
                               double scale, bool causal, double dropout, int64_t seed) {
    const Settings settings{scale, dropout, causal, static_cast<uint64_t>(seed)};
    std::pair<torch::Tensor, torch::Tensor> result;
    switch (q.scalar_type()) {
      case torch::kDouble:
        result = run_forward<double, double>(q, k, v, mask, key_lengths, settings);
        break;
      case torch::kBFloat16:
        result = run_forward<c10::BFloat16, float>(q, k, v, mask, key_lengths, settings);
        break;
      default:
        result = run_forward<float, float>(q, k, v, mask, key_lengths, settings);
        break;
    }
    ctx->save_for_backward({q, k, v, mask, key_lengths, result.first, result.second});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout"] = dropout;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["seed"] = seed;
    return result.first;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& v = saved[2];
    const auto settings = settings_of(ctx);
    std::vector<torch::Tensor> grads;
    switch (q.scalar_type()) {
      case torch::kDouble:
        grads =
            run_backward<double, double>(q, k, v, saved[3], saved[4], saved[5], saved[6], grad_outputs[0], settings);
        break;
      case torch::kBFloat16:
        grads = run_backward<c10::BFloat16, float>(q, k, v, saved[3], saved[4], saved[5], saved[6], grad_outputs[0],
                                                   settings);
        break;
      default:
        grads = run_backward<float, float>(q, k, v, saved[3], saved[4], saved[5], saved[6], grad_outputs[0], settings);
        break;
    }
    return {grads[0],        grads[1],        grads[2],        torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The mask as the kernel reads it: bool, or floating in the accumulation type.
torch::Tensor kernel_mask(const torch::Tensor& mask, torch::ScalarType dtype) {
  if (!mask.defined() || mask.scalar_type() == torch::kBool) return mask;
  return mask.to(dtype == torch::kDouble ? torch::kDouble : torch::kFloat);
}

}  // namespace

bool tiled_supports(const torch::Tensor& q) {
  return q.device().is_cpu() &&
         (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kDouble || q.scalar_type() == torch::kBFloat16);
}

bool tiled_uses_blas() {
#if defined(QKV_HAVE_CBLAS)
  return true;
#else
  return false;
#endif
}

AttentionResult tiled_attention_with_seed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const ScaledDotProductAttentionOptions& options, uint64_t seed) {
  TORCH_CHECK(tiled_supports(q),
              "scaled_dot_product_attention: the tiled backend runs on the CPU in float32, float64 "
              "or bfloat16, got ",
              q.scalar_type(), " on ", q.device());
  const bool grouped = options.enable_gqa() && query_groups(q, k) > 1;
  const auto shaped = to_four_dims(q, k, v, kernel_mask(options.mask(), q.scalar_type()), grouped);
  const auto& lengths = options.key_lengths();
  // Absent masks go to the autograd::Function as empty tensors (it takes no undefined ones).
  const auto key_lengths =
      lengths.defined() ? lengths.to(torch::kCPU, torch::kLong).contiguous() : torch::empty({0}, torch::kLong);
  const auto mask = shaped.mask.defined() ? shaped.mask : torch::empty({0}, torch::kBool);
  const double dropout = options.training() ? options.dropout() : 0.0;
  auto output = TiledAttentionFunction::apply(shaped.q, shaped.k, shaped.v, mask, key_lengths,
                                              resolved_scale(options, q.size(-1)), options.causal(), dropout,
                                              static_cast<int64_t>(seed));
  AttentionResult result;
  result.output = output.reshape(shaped.output_shape);
  result.backend = AttentionBackend::Tiled;
  return result;
}

AttentionResult tiled_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const ScaledDotProductAttentionOptions& options) {
  uint64_t seed = 0;
  if (options.training() && options.dropout() > 0.0) {
    // From LibTorch's CPU generator, so that torch::manual_seed makes runs repeatable.
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    seed = generator.get<at::CPUGeneratorImpl>()->random64();
  }
  return tiled_attention_with_seed(q, k, v, options, seed);
}

torch::Tensor tiled_dropout_keep_mask(uint64_t seed, double p, int64_t batch, int64_t heads, int64_t rows,
                                      int64_t keys) {
  const DropoutStream stream(seed, p);
  auto mask = torch::ones({batch, heads, rows, keys}, torch::kBool);
  if (!stream.active()) return mask;
  std::vector<uint8_t> keep(static_cast<size_t>(keys));
  auto* data = mask.data_ptr<bool>();
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    for (int64_t i = 0; i < rows; ++i) {
      stream.keep(bh, i, 0, keys, keep.data());
      for (int64_t j = 0; j < keys; ++j) data[(bh * rows + i) * keys + j] = keep[j] != 0;
    }
  }
  return mask;
}

}  // namespace qkv::kernels
