#include "kernels/tiled/dropout.h"

#include "kernels/tiled/tiled_cpu.h"
#include "kernels/tiled/vector_math.h"

#include <torch/torch.h>

#include <algorithm>
#include <vector>

namespace qkv::kernels {
namespace tiled {

void Philox::generate(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t out[4]) const {
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

DropoutStream::DropoutStream(uint64_t seed, double p)
    : philox_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)},
      threshold_(static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0))),
      scale_(p > 0 ? 1.0 / (1.0 - p) : 1.0),
      active_(p > 0) {}

uint64_t DropoutStream::row_key(int64_t head, int64_t row) const {
  uint32_t words[4];
  philox_.generate(static_cast<uint32_t>(row), static_cast<uint32_t>(row >> 32), static_cast<uint32_t>(head),
                   static_cast<uint32_t>(head >> 32), words);
  return static_cast<uint64_t>(words[1]) << 32 | words[0];
}

void DropoutStream::keep(int64_t head, int64_t row, int64_t j0, int64_t count, uint8_t* keep) const {
  dropout_keep(row_key(head, row), static_cast<uint32_t>(j0), count, threshold_, keep);
}

}  // namespace tiled

torch::Tensor tiled_dropout_keep_mask(uint64_t seed, double p, int64_t batch, int64_t heads, int64_t rows,
                                      int64_t keys) {
  const tiled::DropoutStream stream(seed, p);
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
