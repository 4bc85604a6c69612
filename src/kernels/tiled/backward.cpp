// The tiled kernel's backward pass. Each task owns one key/value head (and so the dK, dV of all
// its keys and the dQ of the G query heads that share it), or, where whole heads would leave
// threads idle (fewer heads than threads, 3 on 2), a part of its keys (their dK, dV, and a partial
// dQ summed at the end); for every key block it
// recomputes the probabilities P = exp((S - m) - log l) block by block from the forward's row
// statistics (kernel.h), or reads them where the forward kept them (keeps_probabilities), and
// accumulates
// dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K with dS = P ⊙ (dO Vᵀ - rowsum(dO ⊙ O)). Tasks go to
// LibTorch's threads as they become free (task_queue.h), each thread with its own scratch; no task
// writes what another does (no atomics), so results do not depend on the thread that ran them.
// Asked for it, it also writes dS itself: the gradient of an additive mask (a learned bias), summed
// over the batch or the heads where one bias serves them all, by tasks that take every head adding
// to one place of it, one after the other (HeadGroups), where that keeps the threads as busy. Where
// the products multiply bfloat16 (AMX, AVX512_BF16) it accumulates dVᵀ and dKᵀ instead, so that P
// and dS enter their products as right operands, written by one element-wise pass per block
// (softmax_backward_block in vector_math.h).
//
// B = batch, H = query heads, Hkv = key/value heads, G = H / Hkv, N = query rows, S = keys,
// D = head width, Dv = value width.
#include "kernels/tiled/aligned_buffer.h"
#include "kernels/tiled/blocks.h"
#include "kernels/tiled/kernel.h"
#include "kernels/tiled/task_queue.h"
#include "kernels/tiled/vector_math.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace qkv::kernels::tiled {

namespace {

// How many parts to cut each of `heads` heads into (at most `blocks`, its key blocks) so that
// `threads` finish together. Tasks go to the threads as they free up, so heads · parts tasks of
// about equal work take ceil(heads · parts / threads) rounds of 1/parts of a head each: 3 heads on
// 2 threads take 2 heads' time whole and 1.5 cut in two, 1 head on 2 threads 1 whole and 0.5 cut
// in two. The fewest parts that come within 5% of the best: each part costs a partial dQ to sum
// and its own packing of Q and dO.
int64_t parts_per_head(int64_t heads, int64_t threads, int64_t blocks) {
  const auto span = [&](int64_t parts) {  // in heads' time
    return static_cast<double>((heads * parts + threads - 1) / threads) / static_cast<double>(parts);
  };
  int64_t best = 1;
  for (int64_t parts = 2; parts <= std::min(blocks, threads); ++parts) {
    if (span(parts) < 0.95 * span(best)) best = parts;
  }
  return best;
}

// How many parts of its keys each of `tasks` tasks (of one or more heads each) is cut into on
// LibTorch's threads: as parts_per_head says, except that small heads (decoding) stay whole (a
// part must be worth a thread) and so does a single key block.
template <typename acc_t>
int64_t key_parts(const Problem<acc_t>& p, int64_t tasks) {
  const int64_t blocks = (p.S + kKeysPerBlock - 1) / kKeysPerBlock;
  const bool small = tasks_per_chunk(p, p.groups() * p.N) > 1;
  return blocks < 2 || small ? 1 : parts_per_head(tasks, at::get_num_threads(), blocks);
}

// How the backward splits each task's keys into parts run as separate tasks: key_parts of them
// (one where the tasks are a multiple of the threads or far above them), cut at key blocks where
// the work (the rows that see each block: fewer for later blocks when causal, a band with a
// window) is about equal.
class KeySplit {
 public:
  // For `heads` tasks' worth of heads (fewer than B · Hkv where several heads run in one task).
  template <typename acc_t>
  KeySplit(const Problem<acc_t>& p, int64_t heads) {
    const int64_t blocks = (p.S + kKeysPerBlock - 1) / kKeysPerBlock;
    const int64_t parts = key_parts(p, heads);
    // Work of each key block: the query rows that can see it.
    std::vector<double> prefix(static_cast<size_t>(blocks + 1), 0.0);
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t j0 = block * kKeysPerBlock, j1 = std::min(p.S, j0 + kKeysPerBlock);
      prefix[block + 1] = prefix[block] + static_cast<double>(std::max<int64_t>(p.row_limit(j1) - p.row_begin(j0), 1));
    }
    bounds_.push_back(0);
    for (int64_t part = 1; part < parts; ++part) {
      const double target = prefix[blocks] * static_cast<double>(part) / static_cast<double>(parts);
      int64_t block = bounds_.back() + 1;
      while (block < blocks - (parts - part) && prefix[block] < target) ++block;
      bounds_.push_back(block);
    }
    bounds_.push_back(blocks);
    S_ = p.S;
  }
  int64_t parts() const { return static_cast<int64_t>(bounds_.size()) - 1; }
  int64_t first_key(int64_t part) const { return bounds_[part] * kKeysPerBlock; }
  int64_t end_key(int64_t part) const { return std::min(S_, bounds_[part + 1] * kKeysPerBlock); }

 private:
  std::vector<int64_t> bounds_;  // in key blocks
  int64_t S_ = 0;
};

// How the backward's tasks take the B · Hkv key/value heads: `groups` tasks (before the key split)
// of `batches` × `kv_heads` heads each, run one after the other. One head a task, unless an
// additive mask's gradient is summed over the batch or the heads it serves (sums_mask_gradient):
// then the heads that add to one place of it share a task.
struct HeadGroups {
  int64_t batches = 1, kv_heads = 1;  // per group
  int64_t groups = 0;

  bool batch_inner = false;  // groups of one key/value head follow each other (Problem::batch_inner)

  template <typename acc_t>
  static HeadGroups of(const Problem<acc_t>& p, bool mask_gradient_summed) {
    HeadGroups g;
    if (mask_gradient_summed) {
      g.batches = p.mask.batches == 1 ? p.B : 1;
      g.kv_heads = p.mask.heads == 1 ? p.Hkv : 1;
    }
    g.groups = (p.B / g.batches) * (p.Hkv / g.kv_heads);
    g.batch_inner = p.batch_inner();
    return g;
  }
  int64_t heads() const { return batches * kv_heads; }
  // The `member`th head (b, kv_head) of group `group`, as b · Hkv + kv_head.
  int64_t head(int64_t group, int64_t member, int64_t Hkv) const {
    const int64_t kv_groups = Hkv / kv_heads, batch_groups = groups / kv_groups;
    const int64_t batch_group = batch_inner ? group % batch_groups : group / kv_groups;
    const int64_t kv_group = batch_inner ? group / batch_groups : group % kv_groups;
    const int64_t b = batch_group * batches + member / kv_heads;
    const int64_t kv_head = kv_group * kv_heads + member % kv_heads;
    return b * Hkv + kv_head;
  }
};

// The span, in heads' time, of `tasks` tasks of `per_task` heads each, cut into key parts as
// KeySplit cuts them.
template <typename acc_t>
double span_of(const Problem<acc_t>& p, int64_t tasks, int64_t per_task) {
  const int64_t parts = key_parts(p, tasks), threads = at::get_num_threads();
  return static_cast<double>(per_task) * static_cast<double>((tasks * parts + threads - 1) / threads) /
         static_cast<double>(parts);
}

}  // namespace

template <typename acc_t>
bool sums_mask_gradient(const Problem<acc_t>& p) {
  if (p.mask.values == nullptr || (p.mask.batches == p.B && p.mask.heads == p.H)) return true;  // nothing to sum
  const auto grouped = HeadGroups::of(p, true);
  return span_of(p, grouped.groups, grouped.heads()) <= span_of(p, p.B * p.Hkv, 1);
}

template bool sums_mask_gradient<float>(const Problem<float>&);
template bool sums_mask_gradient<double>(const Problem<double>&);

template <typename scalar_t, typename acc_t>
void backward_blocks(const Problem<acc_t>& p, const Matrix4<scalar_t>& q, const Matrix4<scalar_t>& k,
                     const Matrix4<scalar_t>& v, const Matrix4<scalar_t>& out, const Matrix4<scalar_t>& grad_out,
                     const acc_t* row_statistics, const acc_t* probabilities,
                     const Gradients4<scalar_t, acc_t>& grads) {
  acc_t* const grad_scores = grads.scores;
  const int64_t G = p.groups();
  const int64_t row_blocks = (p.N + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t heads = p.B * p.Hkv;
  const auto groups = HeadGroups::of(p, grad_scores != nullptr && grads.scores_summed);
  const KeySplit split(p, groups.groups);
  // Where dS of row i of head (b, h) goes, and whether it adds to what other heads put there
  // (those of the same task, or the G query heads of one key/value head).
  const bool adds_grad_scores =
      grad_scores != nullptr && grads.scores_summed && (p.mask.batches < p.B || p.mask.heads < p.H);
  const auto grad_scores_row = [&](int64_t b, int64_t h, int64_t i) {
    if (!grads.scores_summed) return grad_scores + ((b * p.H + h) * p.N + i) * p.S;
    const int64_t mask_b = p.mask.batches == 1 ? 0 : b, mask_h = p.mask.heads == 1 ? 0 : h;
    return grad_scores + ((mask_b * p.mask.heads + mask_h) * p.N + i) * p.S;
  };
  // With the keys split, each part's dQ is partial: summed over the parts after the tasks.
  AlignedVector<acc_t> partial_grad_q;
  if (split.parts() > 1) partial_grad_q.resize(static_cast<size_t>(heads * split.parts() * G * p.N * p.D));
  run_tasks(groups.groups * split.parts(), tasks_per_chunk(p, groups.heads() * p.groups() * p.N),
            [&](ThreadTasks& tasks) {
    const SingleThreadedBlas single_threaded;
    // On cache lines (aligned_buffer.h): the blocks' tiles and vectors start on one.
    AlignedVector<acc_t> recomputed(kRowsPerBlock * kScoresStride), grad_probabilities(kRowsPerBlock * kScoresStride),
        dropped(kRowsPerBlock * kScoresStride), grad_k_block, grad_v_block, grad_q_all;
    std::vector<acc_t> delta;
    std::vector<uint8_t> keep(kKeysPerBlock);
    const ProductKind kind = product_kind<scalar_t>();
    // bfloat16's dKᵀ and dVᵀ (below) keep their rows kScoresStride apart: AMX accumulates them in
    // place, and tile rows 1 KiB apart fall on the same few sets of the L1 cache.
    const int64_t transposed_stride = kScoresStride;
    grad_k_block.resize(static_cast<size_t>(transposed_stride * p.D));
    grad_v_block.resize(static_cast<size_t>(transposed_stride * p.Dv));
    // The key block's Kᵀ, Vᵀ and K as right operands, and each query block's Q and dO (packed on
    // first use, then reused by every key block of the task).
    RightOperand<scalar_t> keys_transposed, values_transposed, keys;
    std::vector<RightOperand<scalar_t>> queries(kind.bf16 ? 0 : G * row_blocks),
        grad_outputs(kind.bf16 ? 0 : G * row_blocks);
    std::vector<bool> rows_packed;
    // bfloat16 products accumulate dKᵀ = Σ Qᵀ dS and dVᵀ = Σ dOᵀ P (grad_k_block, grad_v_block as
    // D × keys, Dv × keys), whose reduction runs along the query rows as the pairs of AMX's and
    // vdpbf16ps's right operands do: P and dS then go into those panels straight from the block's
    // one element-wise pass, and only Q and dO are transposed, once per query block (left operands
    // of padded_rows columns). The float32 products take Pᵀ and dSᵀ as strided left operands.
    std::vector<AlignedVector<uint16_t>> queries_t(kind.bf16 ? G * row_blocks : 0),
        grad_outputs_t(kind.bf16 ? G * row_blocks : 0);
    PackedRight weight_panels, grad_score_panels;
    AlignedVector<uint16_t> grad_score_rows(kind.bf16 ? kRowsPerBlock * kKeysPerBlock : 0);
    std::vector<uint8_t> keep_block(kind.bf16 && p.dropout.active() ? kRowsPerBlock * kKeysPerBlock : 0);
    AlignedVector<acc_t> keys_by_rows(kind.bf16 ? kKeysPerBlock * std::max(p.D, p.Dv) : 0);
    AlignedVector<float> grad_scores_block(adds_grad_scores && kind.bf16 ? kRowsPerBlock * kKeysPerBlock : 0);
    for (int64_t task = 0; tasks.next(task);) {
      const int64_t group = task / split.parts(), part = task % split.parts();
      for (int64_t member = 0; member < groups.heads(); ++member) {
        const int64_t head = groups.head(group, member, p.Hkv);
        const int64_t kv_head = head % p.Hkv, b = head / p.Hkv;
        rows_packed.assign(static_cast<size_t>(G * row_blocks), false);
        // D_i = rowsum(dO ⊙ O) of every row of the G query heads, and their dQ accumulators (this
        // part's own, when the keys are split).
        delta.assign(static_cast<size_t>(G * p.N), acc_t(0));
        if (split.parts() == 1) grad_q_all.assign(static_cast<size_t>(G * p.N * p.D), acc_t(0));
        acc_t* grad_q_rows = split.parts() > 1
                                 ? partial_grad_q.data() + (head * split.parts() + part) * G * p.N * p.D
                                 : grad_q_all.data();
        if (split.parts() > 1) std::fill(grad_q_rows, grad_q_rows + G * p.N * p.D, acc_t(0));
        // Query block i0 (rows of head h, its transposes at rows_index) against the key block at j0
        // with bfloat16 products: dP, the block's one element-wise pass (from the scores S, or the
        // kept P), and the three products.
        const auto bf16_block = [&](int64_t rows_index, int64_t rows, int64_t padded_rows, int64_t seen, int64_t cols,
                                    int64_t i0, int64_t j0, int64_t g, int64_t h, acc_t factor, const acc_t* scores,
                                    int64_t scores_stride, bool exponentiate) {
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
            values_transposed.multiply_into(Strided<scalar_t>{grad_out.rows(b, h, i0), grad_out.stride_row, 1}, rows,
                                            1.0f, 0.0f, grad_probabilities.data(), kScoresStride, Leading{-1, seen});
            GradScoresBlock block;
            block.rows = rows, block.n = seen;
            block.scores = scores, block.scores_stride = scores_stride;
            block.row_statistics = exponentiate ? statistics_of_row(row_statistics, p, b, h, i0) : nullptr;
            block.factor = factor;
            block.grad_probabilities = grad_probabilities.data(), block.grad_probabilities_stride = kScoresStride;
            block.delta = delta.data() + g * p.N + i0;
            if (p.dropout.active()) {
              for (int64_t r = 0; r < rows; ++r) {
                p.dropout.keep(b * p.H + h, i0 + r, j0, seen, keep_block.data() + r * kKeysPerBlock);
              }
              block.keep = keep_block.data(), block.keep_stride = kKeysPerBlock;
              block.keep_scale = static_cast<float>(p.dropout.scale());
            }
            // dVᵀ's and dKᵀ's reduction: the rows, and a zero row after an odd count (AMX: whole tiles).
            const int64_t reduction = kind.isa == ProductIsa::AmxBf16 ? padded_rows : (rows + 1) / 2 * 2;
            block.weights = weight_panels.bf16_panels_to_fill(reduction, seen, kind);
            block.grad_scores = grad_score_panels.bf16_panels_to_fill(reduction, seen, kind);
            block.grad_score_rows = grad_score_rows.data(), block.grad_score_rows_stride = kKeysPerBlock;
            if (grad_scores != nullptr) {  // dS is the additive mask's gradient, as it is the scores'
              block.grad_scores_float = adds_grad_scores ? grad_scores_block.data() : grad_scores_row(b, h, i0) + j0;
              block.grad_scores_float_stride = adds_grad_scores ? kKeysPerBlock : p.S;
            }
            softmax_backward_block(block);
            if (adds_grad_scores) {
              for (int64_t r = 0; r < rows; ++r) {
                add_into(grad_scores_row(b, h, i0 + r) + j0, seen, grad_scores_block.data() + r * kKeysPerBlock);
              }
            }
            // dVᵀ += dOᵀ (P ⊙ Z / (1 - p)); dKᵀ += Qᵀ dS; dQ += dS K (dK, dQ times the scale when
            // written out)
            const auto left = [&](const AlignedVector<uint16_t>& transposed) {
              return Strided<c10::BFloat16>{reinterpret_cast<const c10::BFloat16*>(transposed.data()), padded_rows, 1};
            };
            multiply(left(grad_outputs_t[rows_index]), p.Dv, weight_panels, 1.0f, 1.0f, grad_v_block.data(),
                     transposed_stride);
            multiply(left(queries_t[rows_index]), p.D, grad_score_panels, 1.0f, 1.0f, grad_k_block.data(),
                     transposed_stride);
            keys.multiply_into(Strided<c10::BFloat16>{reinterpret_cast<const c10::BFloat16*>(grad_score_rows.data()),
                                                      kKeysPerBlock, 1},
                               rows, 1.0f, 1.0f, grad_q_rows + (g * p.N + i0) * p.D, p.D, Leading{seen, -1});
          }
        };
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kv_head * G + g;
          dot_rows(out.rows(b, h, 0), out.stride_row, grad_out.rows(b, h, 0), grad_out.stride_row, p.N, p.Dv,
                   delta.data() + g * p.N);
        }
        const int64_t key_end = p.key_limit(b, p.N);
        for (int64_t j0 = split.first_key(part); j0 < split.end_key(part); j0 += kKeysPerBlock) {
          const int64_t cols = std::min(kKeysPerBlock, p.S - j0);
          if (j0 >= key_end) {  // keys no row attends to: zero gradients
            for (int64_t c = 0; c < cols; ++c) {
              std::fill_n(grads.k.rows(b, kv_head, j0 + c), p.D, scalar_t(0));
              std::fill_n(grads.v.rows(b, kv_head, j0 + c), p.Dv, scalar_t(0));
            }
            continue;
          }
          const scalar_t* k_rows = k.rows(b, kv_head, j0);
          const scalar_t* v_rows = v.rows(b, kv_head, j0);
          if (probabilities == nullptr) keys_transposed.prepare({k_rows, 1, k.stride_row}, p.D, cols);
          values_transposed.prepare({v_rows, 1, v.stride_row}, p.Dv, cols);
          keys.prepare({k_rows, k.stride_row, 1}, cols, p.D);
          std::fill(grad_k_block.begin(), grad_k_block.end(), acc_t(0));
          std::fill(grad_v_block.begin(), grad_v_block.end(), acc_t(0));
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = kv_head * G + g;
            // Only the rows that can see the block: none above its first key when causal, none past
            // its last key + W with a window.
            const int64_t row_end = p.row_limit(j0 + cols);
            for (int64_t i0 = p.row_begin(j0); i0 < row_end; i0 += kRowsPerBlock) {
              const int64_t rows = std::min(kRowsPerBlock, p.N - i0);
              const Strided<scalar_t> q_rows{q.rows(b, h, i0), q.stride_row, 1};
              const Strided<scalar_t> go_rows{grad_out.rows(b, h, i0), grad_out.stride_row, 1};
              const int64_t rows_index = g * row_blocks + i0 / kRowsPerBlock;
              const int64_t padded_rows = (rows + 31) / 32 * 32;
              if (!rows_packed[rows_index]) {
                if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
                  if (kind.bf16) {
                    queries_t[rows_index].resize(static_cast<size_t>(p.D * padded_rows));
                    grad_outputs_t[rows_index].resize(static_cast<size_t>(p.Dv * padded_rows));
                    transpose_bf16(reinterpret_cast<const uint16_t*>(q_rows.data), q.stride_row, rows, p.D, padded_rows,
                                   queries_t[rows_index].data(), padded_rows);
                    transpose_bf16(reinterpret_cast<const uint16_t*>(go_rows.data), grad_out.stride_row, rows, p.Dv,
                                   padded_rows, grad_outputs_t[rows_index].data(), padded_rows);
                  }
                }
                if (!kind.bf16) {
                  queries[rows_index].prepare(q_rows, rows, p.D);
                  grad_outputs[rows_index].prepare(go_rows, rows, p.Dv);
                }
                rows_packed[rows_index] = true;
              }
              // The block's keys these rows can see: a prefix (causal rows end at their own position,
              // a sequence at its length); the rest have P = 0 and no gradient. The blocks of scores
              // and dP keep rows kScoresStride apart (kernel.h), kept probabilities p.S apart.
              const int64_t seen = std::min(cols, p.key_limit(b, i0 + rows) - j0);
              if (seen <= 0) continue;
              // P = exp((S - m) - log l): the forward's probabilities, kept (one key block: j0 = 0, cols = S)
              // or recomputed.
              const acc_t* block_p = recomputed.data();
              const int64_t p_stride = probabilities != nullptr ? p.S : kScoresStride;
              if (probabilities != nullptr) {
                block_p = probabilities + ((b * p.H + h) * p.N + i0) * p.S;
              } else {
                keys_transposed.multiply_into(q_rows, rows, p.product_scale(), acc_t(0), recomputed.data(),
                                              kScoresStride, Leading{-1, seen});
                const acc_t factor =
                    p.apply_masks(b, h, i0, rows, j0, seen, recomputed.data(), kScoresStride, p.deferred_scale());
                if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
                  if (kind.bf16) {  // the exponentials come in the block's one pass below
                    bf16_block(rows_index, rows, padded_rows, seen, cols, i0, j0, g, h, factor, recomputed.data(),
                               kScoresStride, true);
                    continue;
                  }
                }
                for (int64_t r = 0; r < rows; ++r) {
                  const acc_t* statistics = statistics_of_row(row_statistics, p, b, h, i0 + r);
                  acc_t* row = recomputed.data() + r * kScoresStride;
                  if (statistics[0] == std::numeric_limits<acc_t>::infinity()) {  // a row with no key: P = 0
                    std::fill(row, row + seen, acc_t(0));
                  } else {
                    exp_shifted_sum(row, seen, factor, statistics[0], statistics[1]);  // exp((f·S - m) - log l)
                  }
                }
              }
              if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
                if (kind.bf16) {  // P kept by the forward
                  bf16_block(rows_index, rows, padded_rows, seen, cols, i0, j0, g, h, acc_t(1), block_p, p_stride,
                             false);
                  continue;
                }
              }
              // dP = dO Vᵀ
              values_transposed.multiply_into(go_rows, rows, acc_t(1), acc_t(0), grad_probabilities.data(),
                                              kScoresStride, Leading{-1, seen});
              // The forward multiplied P by Z / (1 - p) (Z: the kept pairs): V's gradient takes that
              // product, and dP the same factor.
              const acc_t* value_weights = block_p;
              int64_t value_weights_stride = p_stride;
              if (p.dropout.active()) {
                const acc_t kept = static_cast<acc_t>(p.dropout.scale());
                for (int64_t r = 0; r < rows; ++r) {
                  p.dropout.keep(b * p.H + h, i0 + r, j0, seen, keep.data());
                  const acc_t* row_p = block_p + r * p_stride;
                  acc_t* row_dropped = dropped.data() + r * kScoresStride;
                  acc_t* row_dp = grad_probabilities.data() + r * kScoresStride;
                  for (int64_t c = 0; c < seen; ++c) {
                    row_dropped[c] = keep[c] ? row_p[c] * kept : acc_t(0);
                    row_dp[c] = keep[c] ? row_dp[c] * kept : acc_t(0);
                  }
                }
                value_weights = dropped.data(), value_weights_stride = kScoresStride;
              }
              // dV += (P ⊙ Z / (1 - p))ᵀ dO
              grad_outputs[rows_index].multiply_into(Strided<acc_t>{value_weights, 1, value_weights_stride}, seen,
                                                     acc_t(1), acc_t(1), grad_v_block.data(), p.Dv);
              // dS = P ⊙ (dP - D_i), in place of dP.
              for (int64_t r = 0; r < rows; ++r) {
                softmax_backward(block_p + r * p_stride, grad_probabilities.data() + r * kScoresStride, seen,
                                 delta[g * p.N + i0 + r]);
              }
              if (grad_scores != nullptr) {  // dS is the additive mask's gradient, as it is the scores'
                for (int64_t r = 0; r < rows; ++r) {
                  acc_t* to = grad_scores_row(b, h, i0 + r) + j0;
                  const acc_t* row_ds = grad_probabilities.data() + r * kScoresStride;
                  if (adds_grad_scores) {
                    add_into(to, seen, row_ds);
                  } else {
                    std::memcpy(to, row_ds, sizeof(acc_t) * static_cast<size_t>(seen));
                  }
                }
              }
              // dK += dSᵀ Q; dQ += dS K (each times the scale when it is written out)
              const Strided<acc_t> grad_scores_block{grad_probabilities.data(), kScoresStride, 1};
              queries[rows_index].multiply_into(grad_scores_block.transposed(), seen, acc_t(1), acc_t(1),
                                                grad_k_block.data(), p.D);
              acc_t* grad_q_block = grad_q_rows + (g * p.N + i0) * p.D;
              keys.multiply_into(grad_scores_block, rows, acc_t(1), acc_t(1), grad_q_block, p.D, Leading{seen, -1});
            }
          }
          if constexpr (std::is_same_v<acc_t, float>) {
            if (kind.bf16) {  // dKᵀ, dVᵀ back to rows of keys
              transpose(grad_k_block.data(), transposed_stride, p.D, cols, keys_by_rows.data(), p.D);
              write_scaled_rows(keys_by_rows.data(), p.D, cols, p.D, nullptr, p.scale, grads.k.rows(b, kv_head, j0),
                                grads.k.stride_row);
              transpose(grad_v_block.data(), transposed_stride, p.Dv, cols, keys_by_rows.data(), p.Dv);
              write_scaled_rows(keys_by_rows.data(), p.Dv, cols, p.Dv, nullptr, acc_t(1), grads.v.rows(b, kv_head, j0),
                                grads.v.stride_row);
              continue;
            }
          }
          write_scaled_rows(grad_k_block.data(), p.D, cols, p.D, nullptr, p.scale, grads.k.rows(b, kv_head, j0),
                            grads.k.stride_row);
          write_scaled_rows(grad_v_block.data(), p.Dv, cols, p.Dv, nullptr, acc_t(1), grads.v.rows(b, kv_head, j0),
                            grads.v.stride_row);
        }
        if (split.parts() > 1) continue;  // dQ once every part is done
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kv_head * G + g;
          write_scaled_rows(grad_q_rows + g * p.N * p.D, p.D, p.N, p.D, nullptr, p.scale, grads.q.rows(b, h, 0),
                            grads.q.stride_row);
        }
      }
    }
  });
  if (split.parts() == 1) return;
  // dQ = the sum of the parts' partial dQ, head by head and row by row. The query heads of a
  // key/value head are consecutive: (b, kv_head, g) is query head b·H + kv_head·G + g.
  const int64_t values_per_head = G * p.N * p.D;
  at::parallel_for(0, heads * G * p.N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      // Query head b·H + h and its row i.
      const int64_t head = row / (G * p.N), offset = (row % (G * p.N)) * p.D;
      const int64_t query_head = head * G + (row % (G * p.N)) / p.N, i = row % p.N;
      scalar_t* gq = grads.q.rows(query_head / p.H, query_head % p.H, i);
      for (int64_t d = 0; d < p.D; ++d) {
        acc_t sum = 0;
        for (int64_t part = 0; part < split.parts(); ++part) {
          sum += partial_grad_q[(head * split.parts() + part) * values_per_head + offset + d];
        }
        gq[d] = static_cast<scalar_t>(sum * p.scale);
      }
    }
  });
}

#define QKV_INSTANTIATE_BACKWARD(scalar_t, acc_t)                                                                 \
  template void backward_blocks<scalar_t, acc_t>(const Problem<acc_t>&, const Matrix4<scalar_t>&,                  \
                                                 const Matrix4<scalar_t>&, const Matrix4<scalar_t>&,               \
                                                 const Matrix4<scalar_t>&, const Matrix4<scalar_t>&, const acc_t*, \
                                                 const acc_t*, const Gradients4<scalar_t, acc_t>&);
QKV_INSTANTIATE_BACKWARD(float, float)
QKV_INSTANTIATE_BACKWARD(double, double)
QKV_INSTANTIATE_BACKWARD(c10::BFloat16, float)
QKV_INSTANTIATE_BACKWARD(c10::Half, float)
#undef QKV_INSTANTIATE_BACKWARD

}  // namespace qkv::kernels::tiled
