// Linear layers: x Wᵀ + b as one product with its bias. Private to qkv.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace qkv::detail {

/// Products that go to oneDNN: at least this many multiply-adds (rows · in · out) and 4 rows. Below,
/// oneDNN's fixed cost of about 5 µs per call loses to OpenBLAS (a decoded token's products: M = 1);
/// measured 2026-12-03 on AMD EPYC Zen 5, 2 threads, K = 128: OpenBLAS 0.3.21 (0.3.34) faster up to
/// M·N·K = 2^18 at N = 128 (M = 16), oneDNN faster from 2^19 (M = 32) and at N = 384, 512 from M = 4.
constexpr int64_t kOneDnnFromMultiplyAdds = int64_t{1} << 19;
constexpr int64_t kOneDnnFromRows = 4;

/// x Wᵀ + b, the same values and gradients as at::linear, by the fastest route that takes it:
/// - float32 on the CPU outside autocast, where the process has oneDNN (LibTorch's own, see
///   kernels/linear/onednn_sgemm.h), for products of at least kOneDnnFromMultiplyAdds and
///   kOneDnnFromRows: oneDNN's GEMM for the product and both gradients' products, on the input's
///   rows side by side (a non-contiguous input is made contiguous first, as at::linear does);
///   second-order gradients (create_graph) on LibTorch's differentiable ops;
/// - any other input with 3 or more dimensions, contiguous: its rows side by side in one addmm with
///   the bias (what PyTorch's Python F.linear does on 2.x; the C++ frontend's nn::Linear multiplies
///   first and adds the bias in a second pass, which under bf16 autocast also converts: 3.0 of
///   68.8 ms of a bf16-mixed SelfAttention step at B=8 N=512 E=256 on LibTorch 1.13, 2026-12-01);
/// - everything else: at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace qkv::detail
