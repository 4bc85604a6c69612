// The tiled kernel's two passes and the problem they share, as raw pointers and strides. Whatever
// reaches here has been normalised by operands.cpp (the kernel's one entry). Private to qkv.
//
// B = batch, H = query heads, Hkv = key/value heads, G = H / Hkv, N = query rows, S = keys,
// D = head width, Dv = value width, Br / Bc = rows / keys per block.
#pragma once

#include "kernels/tiled/cpu_features.h"
#include "kernels/tiled/dropout.h"
#include "kernels/tiled/vector_math.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace qkv::kernels::tiled {

// Measured on the 2-core development machine (AMD EPYC; B=8 H=8 N=512 D=32 forward+backward and
// B=1 H=8 N=4096 D=64 forward, float32, Br in {32, 64, 128} × Bc in {64, ..., 512}): 64 × 256 was
// fastest. On an Intel Xeon with AMX, bfloat16 with 128 keys per block was no faster: the tiles
// store a 64 × 128 block of scores (32 KiB, in L1) about twice as fast as 64 × 256, but the
// kernel's other work per block doubled with the number of blocks.
constexpr int64_t kRowsPerBlock = 64;   // Br
constexpr int64_t kKeysPerBlock = 256;  // Bc
// Row stride of the blocks of scores (S, dP): 16 values past a block's width, so that the rows of
// an AMX tile stored straight into them (amx_products.cpp) do not fall 1 KiB apart, on the same few
// sets of the L1 cache. With rows 1 KiB apart those stores made the bfloat16 core 10% slower than
// storing through a buffer; 16 values apart, 5% faster (Intel Xeon with AMX, 2026-12-02).
constexpr int64_t kScoresStride = kKeysPerBlock + 16;
// The most query rows a head for which the forward goes by dot products (Problem::rows_by_dot_products):
// 8 where the row operations take several query rows at a time (AVX-512 and AVX2 tiles), else 4. One
// token of 8 heads of width 64 against 4096 keys, float32, AMD EPYC Zen 5, 2 threads (2026-12-07): 8
// rows took 0.34 ms by dot products 4 at a time and 0.56-0.76 packed, 16 rows 0.87-0.96 against
// 0.71-0.79; on the AVX2 path (QKV_TILED_ISA=avx2, same CPU), 8 rows 0.70 against 0.81 packed and
// 16 rows 1.25 against 1.11 (medians of 8 and 6 interleaved runs).
inline int64_t direct_rows_limit() {
  static const int64_t limit = at_least(active_isa(), ProductIsa::Avx2) ? 8 : 4;
  return limit;
}

/// A 4-D operand (B, H, rows, width) with unit stride along the width and rows at least `width`
/// apart (BLAS's leading dimension): row r of head (b, h) starts at data + b·stride_b + h·stride_h + r·stride_row.
template <typename T>
struct Matrix4 {
  const T* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 0;
  const T* rows(int64_t b, int64_t h, int64_t row) const {
    return data + b * stride_b + h * stride_h + row * stride_row;
  }
};

/// A 4-D result (B, H, rows, width) the kernel writes, laid out as Matrix4: the output and the
/// gradients take the layout of the operand they belong to (operands.cpp), so that the module's
/// head split and join, (B, N, H, D) views, cost no copy in either direction.
template <typename T>
struct OutputMatrix4 {
  T* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 0;
  T* rows(int64_t b, int64_t h, int64_t row) const { return data + b * stride_b + h * stride_h + row * stride_row; }
};

/// The general mask, broadcast to (B, H, N, S) by strides (0 where it broadcasts): bool (true =
/// attend) or additive values in the accumulation type. `batches` and `heads` are its own sizes
/// along B and H: 1 where one mask serves the whole batch or every head.
template <typename acc_t>
struct MaskView {
  const bool* bools = nullptr;
  const acc_t* values = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 0, stride_key = 0;
  int64_t batches = 1, heads = 1;
  bool defined() const { return bools != nullptr || values != nullptr; }
};

template <typename acc_t>
struct Problem {
  int64_t B = 0, H = 0, Hkv = 0, N = 0, S = 0, D = 0, Dv = 0;
  acc_t scale = 1;
  bool causal = false;
  int64_t window = 0;                    // sliding window W (with causal); 0: none
  const int64_t* key_lengths = nullptr;  // (B,) or null
  MaskView<acc_t> mask;
  DropoutStream dropout{0, 0.0};
  bool forward_only = false;  // no backward follows this forward (inference, a decoded token)

  int64_t groups() const { return H / Hkv; }
  // Whether the forward takes each score as a dot product of a query row with a key row, and each
  // output as a weighted sum of value rows, instead of packing the key and value blocks for the
  // block products: for at most direct_rows_limit() query rows a head (a decoded token, a few speculated
  // ones), where packing a block costs more than the few rows' products with it (at N = 1 the
  // packed path took 2.5× PyTorch 2.14's CPU kernel at 4096 keys, float32), and only where no backward
  // follows (the backward recomputes the scores with the block products; the forward's statistics
  // must come from the same products: bfloat16's round the scores differently). Its tasks take the
  // query heads of a key/value head together and split long caches of few heads into key ranges
  // (forward.cpp, forward_by_dot_products).
  bool rows_by_dot_products() const {
    return forward_only && N <= direct_rows_limit() && std::is_same_v<acc_t, float>;
  }
  // Whether the tasks take the batch elements of one head one after the other (head-major order)
  // rather than the heads of one batch element: where one mask of several heads or rows serves the
  // whole batch (a bias (1, H, N, S), ALiBi's or a relative-position table), so that its block of
  // each head is read from the cache B times, not streamed from memory once per batch element.
  bool batch_inner() const {
    return mask.defined() && mask.batches == 1 && B > 1 && (mask.heads > 1 || mask.stride_row != 0);
  }
  // The softmax scale is applied after the block product QKᵀ where it can be, inside the
  // exponential's fused multiply-add (or with an additive mask), so that the product's sums go
  // out as they are; a scale that is not positive (which would turn the row maximum into a
  // minimum) is applied by the product instead.
  bool defers_scale() const { return scale > acc_t(0); }
  acc_t product_scale() const { return defers_scale() ? acc_t(1) : scale; }
  acc_t deferred_scale() const { return defers_scale() ? scale : acc_t(1); }
  // The first key that can matter to rows from i0 on: with a window, none before i0 - W + 1.
  int64_t key_begin(int64_t i0) const { return window > 0 ? std::max<int64_t>(0, i0 - window + 1) : 0; }
  // The first row block's start that can see keys from j0 on: causal rows above j0 never do.
  int64_t row_begin(int64_t j0) const { return causal ? (j0 / kRowsPerBlock) * kRowsPerBlock : 0; }
  // Rows that can see keys [j0, j1): with a window, none from j1 - 1 + W on (as a bound, clipped to N).
  int64_t row_limit(int64_t j1) const { return window > 0 ? std::min(N, j1 - 1 + window) : N; }
  // Keys that can matter to rows [i0, i1) of batch b: past the length and above the diagonal, none.
  int64_t key_limit(int64_t b, int64_t i1) const {
    int64_t limit = S;
    if (key_lengths != nullptr) limit = std::min(limit, std::max<int64_t>(key_lengths[b], 0));
    if (causal) limit = std::min(limit, i1);
    return limit;
  }
  // Scores of rows [i0, i0 + rows) and keys [j0, j0 + cols) after the masks: -inf where masked.
  // They come from the product still to be multiplied by `pending` (deferred_scale()); an additive
  // mask applies it while adding itself. Returns what remains to be applied: `pending`, or 1.
  acc_t apply_masks(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols, acc_t* scores,
                    int64_t ld, acc_t pending) const {
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    const int64_t length = key_lengths != nullptr ? key_lengths[b] : S;
    const bool partial_length = j0 + cols > length;
    const bool partial_causal = causal && j0 + cols - 1 > i0;
    const bool partial_window = window > 0 && j0 <= i0 + rows - 1 - window;
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* row = scores + r * ld;
      const int64_t i = i0 + r;
      if (mask.defined()) {
        const int64_t base = b * mask.stride_b + h * mask.stride_h + i * mask.stride_row;
        if (mask.stride_key == 1) {  // a row of the mask in one piece: vector loops (vector_math.h)
          if (mask.bools != nullptr) {
            mask_out(row, cols, mask.bools + base + j0);
          } else {
            scale_add(row, cols, pending, mask.values + base + j0);
          }
        } else if (mask.bools != nullptr) {
          for (int64_t c = 0; c < cols; ++c) {
            if (!mask.bools[base + (j0 + c) * mask.stride_key]) row[c] = kNegInf;
          }
        } else {
          for (int64_t c = 0; c < cols; ++c) row[c] = row[c] * pending + mask.values[base + (j0 + c) * mask.stride_key];
        }
      }
      if (partial_length) {
        for (int64_t c = std::max<int64_t>(0, length - j0); c < cols; ++c) row[c] = kNegInf;
      }
      if (partial_causal) {
        for (int64_t c = std::max<int64_t>(0, i + 1 - j0); c < cols; ++c) row[c] = kNegInf;
      }
      if (partial_window) {  // keys j <= i - W have left the window
        for (int64_t c = 0; c < std::min(cols, i - window + 1 - j0); ++c) row[c] = kNegInf;
      }
    }
    return mask.values != nullptr ? acc_t(1) : pending;
  }
};

/// Tasks per chunk of at::parallel_for: 1, unless the tasks are so small (decoding one position:
/// one row against the cache) that starting the threads would cost more than the arithmetic; then
/// enough of them to make about 1 MFLOP per chunk, which keeps a decoded token's attention on the
/// calling thread.
template <typename acc_t>
int64_t tasks_per_chunk(const Problem<acc_t>& p, int64_t rows_per_task) {
  constexpr double kFlopsPerChunk = 1e6;
  const double flops = 4.0 * static_cast<double>(rows_per_task) * static_cast<double>(p.S) *
                       static_cast<double>(std::max(p.D, p.Dv));
  return std::max<int64_t>(1, static_cast<int64_t>(kFlopsPerChunk / std::max(flops, 1.0)));
}

/// The most bytes of probabilities (B, H, N, S) a forward keeps for its backward.
constexpr int64_t kKeptProbabilitiesBytes = int64_t{32} << 20;

/// Whether the forward keeps the probabilities P for the backward instead of the backward
/// recomputing them: when every row's keys fit one key block (S <= Bc: the forward's P of a row is
/// final after its one block, and keeping it spares the backward a product, the exponentials and
/// a packing per head: a quarter of a small problem's time) and P is small beside what the
/// caller's autograd graph keeps anyway (at most kKeptProbabilitiesBytes).
template <typename acc_t>
bool keeps_probabilities(const Problem<acc_t>& p) {
  const double bytes = static_cast<double>(p.B) * static_cast<double>(p.H) * static_cast<double>(p.N) *
                       static_cast<double>(p.S) * sizeof(acc_t);
  return p.S <= kKeysPerBlock && bytes <= static_cast<double>(kKeptProbabilitiesBytes);
}

/// The softmax statistics of each row, from which the backward recomputes P = exp((factor · S - m)
/// - log l): kRowStatistics values a row (vector_math.h), (B, H, N, 2) contiguous: m, the shift
/// the forward's exponentials took (the row's largest scaled score; with bfloat16 weights possibly the largest of
/// the blocks before, forward.cpp), and log l, of the sum of those exponentials; m = +inf for a row
/// with no key. Not one log-sum-exp L = m + log l: where the scores are huge in magnitude, as in a
/// row that a finite mask (-1e9, or the dtype's lowest value) covers entirely, m + log l rounds to
/// m, and exp(S - L) came out l times too large (P = 1 for every key of such a row: gradients off by
/// a factor of S; found by the differential test, 2026-12-04). Forming factor · S - m first, by the
/// same fused multiply-add in both passes, gives such a row's scores exactly exp(0) in both.
using kernels::kRowStatistics;

/// Where row i of head (b, h) has its statistics within `row_statistics`.
template <typename acc_t, typename T>
T* statistics_of_row(T* row_statistics, const Problem<acc_t>& p, int64_t b, int64_t h, int64_t i) {
  return row_statistics + ((b * p.H + h) * p.N + i) * kRowStatistics;
}

/// Forward: out (B, H, N, Dv) and the rows' statistics (kRowStatistics); where `probabilities` is
/// not null (keeps_probabilities), also P (B, H, N, S) contiguous, before dropout, 0 for masked
/// pairs. Instantiated for (float, float), (double, double), (BFloat16, float), (Half, float).
template <typename scalar_t, typename acc_t>
void forward_blocks(const Problem<acc_t>& p, const Matrix4<scalar_t>& q, const Matrix4<scalar_t>& k,
                    const Matrix4<scalar_t>& v, const OutputMatrix4<scalar_t>& out, acc_t* row_statistics,
                    acc_t* probabilities);

/// The backward's results: grad_q (B, H, N, D), grad_k (B, Hkv, S, D), grad_v (B, Hkv, S, Dv); when
/// scores is not null it receives dS, the gradient of the scores after the mask, which is the
/// gradient of an additive mask: (B, H, N, S) contiguous, one per batch element and head, for the
/// caller to sum over the mask's broadcast; or, where scores_summed (sums_mask_gradient), summed
/// over them already, (mask.batches, mask.heads, N, S) contiguous. It must be zero-filled on entry.
template <typename scalar_t, typename acc_t>
struct Gradients4 {
  OutputMatrix4<scalar_t> q, k, v;
  acc_t* scores = nullptr;
  bool scores_summed = false;
};

/// Whether the backward sums an additive mask's gradient over the batch and heads it serves
/// (Gradients4::scores_summed): the heads that add to one place run one after the other in one task
/// (no two tasks write the same place, and the order of the sums is fixed), where such tasks keep
/// the threads as busy as one task per head would. Otherwise the caller sums (B, H, N, S).
template <typename acc_t>
bool sums_mask_gradient(const Problem<acc_t>& p);

/// Backward: the gradients from out and grad_out (B, H, N, Dv) and the forward's row statistics, or
/// its probabilities where it kept them (else null).
template <typename scalar_t, typename acc_t>
void backward_blocks(const Problem<acc_t>& p, const Matrix4<scalar_t>& q, const Matrix4<scalar_t>& k,
                     const Matrix4<scalar_t>& v, const Matrix4<scalar_t>& out, const Matrix4<scalar_t>& grad_out,
                     const acc_t* row_statistics, const acc_t* probabilities,
                     const Gradients4<scalar_t, acc_t>& grads);

}  // namespace qkv::kernels::tiled
