// The tiled kernel's forward pass, in the manner of FlashAttention-2: each task takes a block of
// query rows of one head and streams the key/value blocks past it, keeping a running row maximum m
// and sum l (the online softmax), so that the (N, S) scores never exist beyond one block; it saves
// the rows' log-sum-exp L = m + log l for the backward. Tasks run under at::parallel_for with
// per-thread scratch. bfloat16 blocks are converted to float32 and accumulate in float32.
//
// B = batch, H = query heads, N = query rows, S = keys, D = head width, Dv = value width.
#include "kernels/tiled/blocks.h"
#include "kernels/tiled/kernel.h"
#include "kernels/tiled/vector_math.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <limits>
#include <vector>

namespace qkv::kernels::tiled {

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
      for (int64_t j0 = p.key_begin(i0); j0 < key_end; j0 += kKeysPerBlock) {  // a window skips older keys
        const int64_t cols = std::min(kKeysPerBlock, key_end - j0);
        int64_t ldk = 0, ldv = 0;
        const acc_t* k_rows = rows_as<scalar_t, acc_t>(k.rows(b, kv_head, j0), k.stride_row, cols, p.D, k_scratch, ldk);
        const acc_t* v_rows =
            rows_as<scalar_t, acc_t>(v.rows(b, kv_head, j0), v.stride_row, cols, p.Dv, v_scratch, ldv);
        // Steps 1 and 2: scaled scores of the block.
        gemm(false, true, rows, cols, p.D, p.scale, q_rows, ldq, k_rows, ldk, acc_t(0), scores.data(), cols);
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
        gemm(false, false, rows, p.Dv, cols, acc_t(1), scores.data(), cols, v_rows, ldv, acc_t(1),
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

template void forward_blocks<float, float>(const Problem<float>&, const Matrix4<float>&, const Matrix4<float>&,
                                           const Matrix4<float>&, float*, float*);
template void forward_blocks<double, double>(const Problem<double>&, const Matrix4<double>&, const Matrix4<double>&,
                                             const Matrix4<double>&, double*, double*);
template void forward_blocks<c10::BFloat16, float>(const Problem<float>&, const Matrix4<c10::BFloat16>&,
                                                   const Matrix4<c10::BFloat16>&, const Matrix4<c10::BFloat16>&,
                                                   c10::BFloat16*, float*);

}  // namespace qkv::kernels::tiled
