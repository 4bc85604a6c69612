// Which dtypes qkv counts as half precision. Private to qkv.
#pragma once

#include <c10/core/ScalarType.h>

namespace qkv::detail {

/// bfloat16 or float16: the types whose CPU operations qkv computes in float32 and rounds once
/// where LibTorch's own would round more often (math path, LayerNorm, RoPE).
inline bool half_precision(c10::ScalarType dtype) { return dtype == c10::kBFloat16 || dtype == c10::kHalf; }

}  // namespace qkv::detail
