// The tiled kernel's forward pass, in the manner of FlashAttention-2: each task takes a block of
// query rows of one head and streams the key/value blocks past it, keeping a running row maximum m
// and sum l (the online softmax), so that the (N, S) scores never exist beyond one block; it saves
// each row's m and log l for the backward (apart, not as L = m + log l: kernel.h). Tasks (row
// blocks of a head) go to LibTorch's threads as they become free (task_queue.h), each thread with
// its own scratch. The block products run on qkv's micro-kernels (packed_products.h); bfloat16
// blocks multiply in bfloat16 where the CPU has AVX512_BF16, else as float32, float16 blocks always
// as float32 (widened exactly), and all accumulate in float32. A few query rows with no backward to
// follow (a decoded token) take dot products with the key rows instead (forward_by_dot_products).
//
// B = batch, H = query heads, N = query rows, S = keys, D = head width, Dv = value width.
#include "kernels/tiled/aligned_buffer.h"
#include "kernels/tiled/blocks.h"
#include "kernels/tiled/kernel.h"
#include "kernels/tiled/task_queue.h"
#include "kernels/tiled/vector_math.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace qkv::kernels::tiled {

namespace {

// How far above the row maximum so far a block's scores may lie and still be exponentiated with
// that maximum as their shift (the bfloat16 weights' speculative shift, below): e^8 ≈ 3000.
constexpr float kShiftSlack = 8.0f;

// The packed key and value blocks of one key/value head, kept by a thread from task to task: its
// tasks come in chunks of consecutive row blocks (and, with GQA, heads) of mostly the same
// key/value head, so each block is packed about once per chunk and head rather than once per row block.
//
// Value blocks that few query rows meet (borrow_values: at most kRowsPerBlock rows of all the heads
// that share them, such as a chunk of a prompt against a long cache) are read where they lie
// instead (PackedRight::borrow): packed, each was copied to be used once or twice, and the copy cost
// a tenth of the forward. 16 and 32 rows of 8 heads of width 64 against 4096 keys, float32, AMD EPYC
// Zen 5, 2 threads, 2026-12-07: 1.38 -> 1.20 ms and 2.51 -> 2.15 on AVX2 (QKV_TILED_ISA=avx2),
// 0.82 -> 0.72 and 1.26 -> 1.17 on AVX-512; 64 rows 0.95× and 1.00× (medians of 5-6 interleaved runs).
// The key blocks are transposed for their products (Kᵀ), so always packed.
template <typename scalar_t>
class PackedHead {
 public:
  explicit PackedHead(bool borrow_values) : borrow_values_(borrow_values) {}
  // Forgets the blocks when (b, kv_head) changes.
  void select(int64_t b, int64_t kv_head, int64_t blocks) {
    if (b == b_ && kv_head == kv_head_) return;
    b_ = b, kv_head_ = kv_head;
    if (static_cast<int64_t>(keys_.size()) < blocks) keys_.resize(blocks), values_.resize(blocks);
    packed_.assign(static_cast<size_t>(blocks), false);
  }
  // Kᵀ (D × cols) and V (cols × Dv) of key block `block`, packed (or V borrowed) on first use.
  template <typename acc_t>
  std::pair<const RightOperand<scalar_t>*, const RightOperand<scalar_t>*> block(
      const Problem<acc_t>& p, const Matrix4<scalar_t>& k, const Matrix4<scalar_t>& v, int64_t block, int64_t j0,
      int64_t cols) {
    if (!packed_[block]) {
      keys_[block].prepare({k.rows(b_, kv_head_, j0), 1, k.stride_row}, p.D, cols);
      values_[block].prepare({v.rows(b_, kv_head_, j0), v.stride_row, 1}, cols, p.Dv, borrow_values_);
      packed_[block] = true;
    }
    return {&keys_[block], &values_[block]};
  }

 private:
  const bool borrow_values_;
  int64_t b_ = -1, kv_head_ = -1;
  std::vector<RightOperand<scalar_t>> keys_, values_;
  std::vector<bool> packed_;
};

// The online softmax's state of a few query rows over a range of keys: each row's maximum so far m,
// its sum of exponentials l (relative to m) and its weighted values (relative to m, Dv a row).
struct RowsState {
  std::vector<float> row_max, row_sum;
  AlignedVector<float> accumulator;
  void reset(int64_t rows, int64_t width) {
    row_max.assign(static_cast<size_t>(rows), -std::numeric_limits<float>::infinity());
    row_sum.assign(static_cast<size_t>(rows), 0.0f);
    accumulator.assign(static_cast<size_t>(rows * width), 0.0f);
  }
};

// A row's statistics (m, log l; m = +inf for a row that attended to no key: kernel.h) written
// from its running maximum and sum; returns the factor of its output, 1 / l (0 for such a row).
template <typename acc_t>
acc_t finish_row(acc_t row_max, acc_t row_sum, acc_t* statistics) {
  const bool dead = row_sum == acc_t(0);
  statistics[0] = dead ? std::numeric_limits<acc_t>::infinity() : row_max;
  statistics[1] = dead ? acc_t(0) : std::log(row_sum);
  return dead ? acc_t(0) : acc_t(1) / row_sum;
}

// Row r's output (accumulator / l; 0 for a row that attended to no key) rounded to scalar_t, and
// its statistics.
template <typename scalar_t>
void write_row(const Problem<float>& p, float row_max, float row_sum, const float* accumulator, scalar_t* out,
               float* statistics) {
  const float inverse_sum = finish_row(row_max, row_sum, statistics);
  write_scaled_rows(accumulator, p.Dv, 1, p.Dv, &inverse_sum, 1.0f, out, p.Dv);
}

// The forward of a few query rows a head with no backward to follow (Problem::rows_by_dot_products):
// a decoded token, a few speculated ones. Each score is a query row's dot product with a key row
// and each output a weighted sum of value rows, in float32, nothing packed; the online softmax,
// masks, key lengths, windows and dropout as in forward_blocks.
//
// Tasks: one per (batch element, key/value head, range of keys). A task takes the rows of every
// query head that shares its key/value head (grouped-query attention: G = H / Hkv heads), so that
// each key and value row is streamed from memory once for all of them, not once per head (the
// block's rows are then read again from the cache for the other heads' rows). Where batch elements
// times key/value heads make fewer than kDecodeTasks tasks, the keys are split into ranges of whole
// blocks (as in FlashDecoding), so that a single head against a long cache keeps every thread busy:
// each range's rows end with their own (m, l, weighted values), merged afterwards by the max-rescale
// of the online softmax. The split depends on the shape alone, never on the threads, so that a
// result does not change with the thread count.
constexpr int64_t kDecodeTasks = 8;
// The fewest keys a range of a split takes: below this, the merge and a thread's handover cost
// more than the range's dot products.
constexpr int64_t kDecodeKeysPerRange = 2 * kKeysPerBlock;

// The ranges of a head's keys: `count` ranges of `keys` keys each (whole blocks; the last one the rest).
struct KeyRanges {
  int64_t count = 1, keys = 0;
};

KeyRanges decode_key_ranges(const Problem<float>& p) {
  const int64_t heads = p.B * p.Hkv, key_blocks = (p.S + kKeysPerBlock - 1) / kKeysPerBlock;
  if (heads == 0 || heads >= kDecodeTasks || key_blocks == 0) return {1, key_blocks * kKeysPerBlock};
  const int64_t wanted = std::max<int64_t>(1, std::min((kDecodeTasks + heads - 1) / heads, p.S / kDecodeKeysPerRange));
  const int64_t blocks = (key_blocks + wanted - 1) / wanted;
  return {(key_blocks + blocks - 1) / blocks, blocks * kKeysPerBlock};  // no range left empty
}

template <typename scalar_t>
void forward_by_dot_products(const Problem<float>& p, const Matrix4<scalar_t>& q, const Matrix4<scalar_t>& k,
                             const Matrix4<scalar_t>& v, const OutputMatrix4<scalar_t>& out, float* row_statistics) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t G = p.groups(), rows = G * p.N;  // a task's rows: row g·N + i is row i of head kv_head·G + g
  const KeyRanges split = decode_key_ranges(p);
  const int64_t ranges = split.count, range_keys = split.keys;
  // The ranges' states for the merge (ranges > 1): per task, rows × (m, l, Dv values).
  const int64_t state_width = 2 + p.Dv;
  std::vector<float> range_states(ranges > 1 ? static_cast<size_t>(p.B * p.Hkv * ranges * rows * state_width) : 0);
  // Tasks of about 1 MFLOP at least (tasks_per_chunk): a short cache's token stays on one thread.
  const double task_flops = 4.0 * static_cast<double>(rows) * static_cast<double>(std::min(p.S, range_keys)) *
                            static_cast<double>(std::max(p.D, p.Dv));
  const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(1e6 / std::max(task_flops, 1.0)));
  using values_t = std::remove_cv_t<std::remove_pointer_t<decltype(vector_values(q.data))>>;
  run_tasks(p.B * p.Hkv * ranges, chunk, [&](ThreadTasks& tasks) {
    AlignedVector<float> scores(static_cast<size_t>(rows * kScoresStride));
    std::vector<uint8_t> keep(kKeysPerBlock);
    std::vector<const values_t*> query_rows(static_cast<size_t>(rows));
    RowsState state;
    for (int64_t task = 0; tasks.next(task);) {
      const int64_t range = task % ranges, b = task / ranges / p.Hkv, kv_head = task / ranges % p.Hkv;
      state.reset(rows, p.Dv);
      for (int64_t r = 0; r < rows; ++r) query_rows[r] = vector_values(q.rows(b, kv_head * G + r / p.N, r % p.N));
      const int64_t key_begin = std::max(p.key_begin(0), range * range_keys);
      const int64_t key_end = std::min(p.key_limit(b, p.N), (range + 1) * range_keys);
      for (int64_t j0 = key_begin; j0 < key_end; j0 += kKeysPerBlock) {
        const int64_t cols = std::min(kKeysPerBlock, key_end - j0);
        // Steps 1 and 2: every row's scores against the block's key rows.
        dots_with_rows(query_rows.data(), rows, vector_values(k.rows(b, kv_head, j0)), k.stride_row, cols, p.D,
                       scores.data(), kScoresStride);
        if (p.product_scale() != 1.0f) {
          for (int64_t r = 0; r < rows; ++r) scale(scores.data() + r * kScoresStride, cols, p.product_scale());
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kv_head * G + g;
          float* head_scores = scores.data() + g * p.N * kScoresStride;
          const float factor = p.apply_masks(b, h, 0, p.N, j0, cols, head_scores, kScoresStride, p.deferred_scale());
          // Step 3, online: rescale what was accumulated to the new row maximum, add this block.
          for (int64_t i = 0; i < p.N; ++i) {
            const int64_t r = g * p.N + i;
            float* row = head_scores + i * kScoresStride;
            const float new_max = nan_max(state.row_max[r], factor * max_of(row, cols));
            if (new_max == kNegInf) {  // nothing attended yet in this row
              std::fill(row, row + cols, 0.0f);
              continue;
            }
            const float correction = std::exp(state.row_max[r] - new_max);  // 0 on the row's first keys
            state.row_sum[r] = state.row_sum[r] * correction + exp_shifted_sum(row, cols, factor, new_max);
            state.row_max[r] = new_max;
            if (correction != 1.0f) scale(state.accumulator.data() + r * p.Dv, p.Dv, correction);
            if (p.dropout.active()) {
              p.dropout.keep(b * p.H + h, i, j0, cols, keep.data());
              const float kept = static_cast<float>(p.dropout.scale());
              for (int64_t c = 0; c < cols; ++c) row[c] = keep[c] ? row[c] * kept : 0.0f;
            }
          }
        }
        // Step 4: the block's weighted values, every row of the task against the same value rows.
        add_weighted_rows(vector_values(v.rows(b, kv_head, j0)), v.stride_row, cols, p.Dv, scores.data(), kScoresStride,
                          rows, state.accumulator.data(), p.Dv);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = kv_head * G + r / p.N, i = r % p.N;
        const float* accumulator = state.accumulator.data() + r * p.Dv;
        if (ranges == 1) {
          write_row(p, state.row_max[r], state.row_sum[r], accumulator, out.rows(b, h, i),
                    statistics_of_row(row_statistics, p, b, h, i));
        } else {
          float* kept = range_states.data() + (task * rows + r) * state_width;
          kept[0] = state.row_max[r], kept[1] = state.row_sum[r];
          std::copy(accumulator, accumulator + p.Dv, kept + 2);
        }
      }
    }
  });
  if (ranges == 1) return;
  // The merge: each row's ranges rescaled to their largest maximum m and added. A range in which
  // the row attended to no key (m = -inf, l = 0) adds nothing; a NaN maximum (a NaN score) makes the
  // row NaN, as it does unsplit.
  std::vector<float> merged(static_cast<size_t>(p.Dv));
  for (int64_t bkv = 0; bkv < p.B * p.Hkv; ++bkv) {
    const int64_t b = bkv / p.Hkv, kv_head = bkv % p.Hkv;
    for (int64_t r = 0; r < rows; ++r) {
      const auto state_of = [&](int64_t range) {
        return range_states.data() + ((bkv * ranges + range) * rows + r) * state_width;
      };
      float row_max = kNegInf, row_sum = 0.0f;
      for (int64_t range = 0; range < ranges; ++range) row_max = nan_max(row_max, state_of(range)[0]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      for (int64_t range = 0; range < ranges && row_max != kNegInf; ++range) {
        const float* kept = state_of(range);
        if (kept[0] == kNegInf) continue;
        const float weight = std::exp(kept[0] - row_max);
        row_sum += kept[1] * weight;
        for (int64_t d = 0; d < p.Dv; ++d) merged[d] += weight * kept[2 + d];
      }
      const int64_t h = kv_head * G + r / p.N, i = r % p.N;
      write_row(p, row_max, row_sum, merged.data(), out.rows(b, h, i), statistics_of_row(row_statistics, p, b, h, i));
    }
  }
}

}  // namespace

template <typename scalar_t, typename acc_t>
void forward_blocks(const Problem<acc_t>& p, const Matrix4<scalar_t>& q, const Matrix4<scalar_t>& k,
                    const Matrix4<scalar_t>& v, const OutputMatrix4<scalar_t>& out, acc_t* row_statistics,
                    acc_t* probabilities) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (p.rows_by_dot_products()) return forward_by_dot_products(p, q, k, v, out, row_statistics);
  }
  const int64_t row_blocks = (p.N + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t key_blocks = (p.S + kKeysPerBlock - 1) / kKeysPerBlock;
  const int64_t task_count = p.B * p.H * row_blocks;
  run_tasks(task_count, tasks_per_chunk(p, std::min(p.N, kRowsPerBlock)), [&](ThreadTasks& tasks) {
    const SingleThreadedBlas single_threaded;
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    // On cache lines (aligned_buffer.h): the blocks' tiles and vectors start on one.
    AlignedVector<acc_t> scores(kRowsPerBlock * kScoresStride), accumulator;
    std::vector<acc_t> row_max(kRowsPerBlock), row_sum(kRowsPerBlock), inverse_sum(kRowsPerBlock);
    std::vector<uint8_t> keep(kKeysPerBlock);
    accumulator.resize(static_cast<size_t>(kRowsPerBlock * p.Dv));
    // Where the block products multiply bfloat16, the weights of step 4 go straight from the
    // exponential into bfloat16 (unless they are kept for the backward or dropped out first).
    const bool bf16_products = product_kind<scalar_t>().bf16;
    const bool bf16_weights = bf16_products && probabilities == nullptr && !p.dropout.active();
    AlignedVector<c10::BFloat16> weights(bf16_weights ? kRowsPerBlock * kKeysPerBlock : 0);
    PackedHead<scalar_t> head(p.N * p.groups() <= kRowsPerBlock);
    // A window's unaligned block, packed for one use (see below); kept here so that its storage is reused.
    RightOperand<scalar_t> narrow_keys, narrow_values;
    const bool batch_inner = p.batch_inner();
    for (int64_t task = 0; tasks.next(task);) {
      const int64_t block = task % row_blocks, bh = task / row_blocks;
      const int64_t h = batch_inner ? bh / p.B : bh % p.H, b = batch_inner ? bh % p.B : bh / p.H;
      const int64_t kv_head = h / p.groups();
      const int64_t i0 = block * kRowsPerBlock, rows = std::min(kRowsPerBlock, p.N - i0);
      const Strided<scalar_t> q_rows{q.rows(b, h, i0), q.stride_row, 1};
      head.select(b, kv_head, key_blocks);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), acc_t(0));
      std::fill(accumulator.begin(), accumulator.end(), acc_t(0));
      const int64_t key_end = p.key_limit(b, i0 + rows);
      // Kept probabilities (keeps_probabilities: S <= Bc, so the loop below runs at most once, over
      // keys [key_begin, key_end)): the pairs outside those keys are 0, written here; the loop
      // writes the rest (0 for a row that attends to nothing). Filling only what the loop does not
      // write spares a causal block most of a pass over its P.
      acc_t* kept_rows = probabilities != nullptr ? probabilities + ((b * p.H + h) * p.N + i0) * p.S : nullptr;
      if (kept_rows != nullptr) {
        const int64_t written_begin = std::min(p.key_begin(i0), p.S);
        const int64_t written_end = std::max(written_begin, key_end);
        for (int64_t r = 0; r < rows; ++r) {
          acc_t* kept = kept_rows + r * p.S;
          std::fill(kept, kept + written_begin, acc_t(0));
          std::fill(kept + written_end, kept + p.S, acc_t(0));
        }
      }
      for (int64_t j0 = p.key_begin(i0); j0 < key_end; j0 += kKeysPerBlock) {  // a window skips older keys
        const int64_t cols = std::min(kKeysPerBlock, key_end - j0);
        // Blocks on the block grid are packed once, whole, and reused: a causal or length-limited
        // block's rows see a prefix of it (its first `cols` keys). A window's unaligned blocks are
        // packed here, for one use.
        const bool aligned = j0 % kKeysPerBlock == 0;
        const RightOperand<scalar_t>*keys = &narrow_keys, *values = &narrow_values;
        if (aligned) {
          std::tie(keys, values) = head.block(p, k, v, j0 / kKeysPerBlock, j0, std::min(kKeysPerBlock, p.S - j0));
        } else {
          narrow_keys.prepare({k.rows(b, kv_head, j0), 1, k.stride_row}, p.D, cols);
          narrow_values.prepare({v.rows(b, kv_head, j0), v.stride_row, 1}, cols, p.Dv);
        }
        // Steps 1 and 2: scores of the block (scaled here, or by the exponential below: `factor`).
        keys->multiply_into(q_rows, rows, p.product_scale(), acc_t(0), scores.data(), kScoresStride,
                            Leading{-1, cols});
        const acc_t factor =
            p.apply_masks(b, h, i0, rows, j0, cols, scores.data(), kScoresStride, p.deferred_scale());
        // Step 3, online: rescale what was accumulated to the new row maximum, add this block.
        for (int64_t r = 0; r < rows; ++r) {
          acc_t* row = scores.data() + r * kScoresStride;
          uint16_t* row_weights = bf16_weights ? reinterpret_cast<uint16_t*>(weights.data() + r * cols) : nullptr;
          if constexpr (std::is_same_v<acc_t, float>) {
            // bfloat16 weights after a row's first block with a key: exponentials shifted by the row
            // maximum so far, the block's own maximum taken in the same pass, kept unless it rose
            // more than kShiftSlack above (weights up to e^kShiftSlack: no overflow; row_sum and the
            // accumulator stay relative to the same row_max; a NaN score makes the sum, and so the
            // row, NaN either way). Otherwise, and for every other block, a pass for the maximum first.
            if (bf16_weights && row_max[r] > kNegInf) {
              float largest = kNegInf;
              const float sum = exp_shifted_sum_to_bf16(row, cols, factor, row_max[r], row_weights, &largest);
              if (factor * largest <= row_max[r] + kShiftSlack) {
                row_sum[r] += sum;
                continue;
              }
            }
          }
          const acc_t new_max = nan_max(row_max[r], factor * max_of(row, cols));
          if (new_max == kNegInf) {  // nothing attended yet in this row
            if (bf16_weights) {
              std::fill_n(row_weights, cols, uint16_t(0));
            } else {
              std::fill(row, row + cols, acc_t(0));
            }
            if (kept_rows != nullptr) std::fill_n(kept_rows + r * p.S + j0, cols, acc_t(0));
            continue;
          }
          const acc_t correction = std::exp(row_max[r] - new_max);  // exp(-inf) = 0 on the first block
          acc_t sum;
          if constexpr (std::is_same_v<acc_t, float>) {
            // Weights that bfloat16 products take, whether rounded here or kept in float32 for the
            // backward or dropout first, are the same exponentials: the output does not depend on
            // whether a backward follows (a checkpoint's recomputation gives the forward's output).
            if (bf16_weights) {
              sum = exp_shifted_sum_to_bf16(row, cols, factor, new_max, row_weights);
            } else if (bf16_products) {
              sum = exp_shifted_sum_for_bf16(row, cols, factor, new_max);
            } else {
              sum = exp_shifted_sum(row, cols, factor, new_max);
            }
          } else {
            sum = exp_shifted_sum(row, cols, factor, new_max);
          }
          row_sum[r] = row_sum[r] * correction + sum;
          row_max[r] = new_max;
          if (correction != acc_t(1)) scale(accumulator.data() + r * p.Dv, p.Dv, correction);
          if (kept_rows != nullptr) {  // one key block (keeps_probabilities): this row's sum is final
            acc_t* kept = kept_rows + r * p.S + j0;
            const acc_t inverse = acc_t(1) / row_sum[r];
            for (int64_t c = 0; c < cols; ++c) kept[c] = row[c] * inverse;
          }
          if (p.dropout.active()) {
            p.dropout.keep(b * p.H + h, i0 + r, j0, cols, keep.data());
            const acc_t kept = static_cast<acc_t>(p.dropout.scale());
            for (int64_t c = 0; c < cols; ++c) row[c] = keep[c] ? row[c] * kept : acc_t(0);
          }
        }
        // Step 4: the block's weighted values.
        if constexpr (std::is_same_v<acc_t, float>) {
          if (bf16_weights) {
            values->multiply_into(Strided<c10::BFloat16>{weights.data(), cols, 1}, rows, acc_t(1), acc_t(1),
                                  accumulator.data(), p.Dv, Leading{cols, -1});
            continue;
          }
        }
        values->multiply_into(Strided<acc_t>{scores.data(), kScoresStride, 1}, rows, acc_t(1), acc_t(1),
                              accumulator.data(), p.Dv, Leading{cols, -1});
      }
      // The rows' outputs (accumulator / row_sum; 0 for a row that attends to nothing) and their
      // statistics (m, log l), kept apart (kernel.h).
      for (int64_t r = 0; r < rows; ++r) {
        inverse_sum[r] = finish_row(row_max[r], row_sum[r], statistics_of_row(row_statistics, p, b, h, i0 + r));
      }
      write_scaled_rows(accumulator.data(), p.Dv, rows, p.Dv, inverse_sum.data(), acc_t(1), out.rows(b, h, i0),
                        out.stride_row);
    }
  });
}

template void forward_blocks<float, float>(const Problem<float>&, const Matrix4<float>&, const Matrix4<float>&,
                                           const Matrix4<float>&, const OutputMatrix4<float>&, float*, float*);
template void forward_blocks<double, double>(const Problem<double>&, const Matrix4<double>&, const Matrix4<double>&,
                                             const Matrix4<double>&, const OutputMatrix4<double>&,
                                             double*, double*);
template void forward_blocks<c10::BFloat16, float>(const Problem<float>&, const Matrix4<c10::BFloat16>&,
                                                   const Matrix4<c10::BFloat16>&, const Matrix4<c10::BFloat16>&,
                                                   const OutputMatrix4<c10::BFloat16>&, float*, float*);
template void forward_blocks<c10::Half, float>(const Problem<float>&, const Matrix4<c10::Half>&,
                                               const Matrix4<c10::Half>&, const Matrix4<c10::Half>&,
                                               const OutputMatrix4<c10::Half>&, float*, float*);

}  // namespace qkv::kernels::tiled
