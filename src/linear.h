// Linear layers: x Wᵀ + b as one product with its bias. Private to qkv.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace qkv::detail {

/// Products that go to the GEMM route (oneDNN's GEMM or qkv's micro-kernels, below): at least this
/// many multiply-adds (rows · in · out) and 4 rows. Below, oneDNN's fixed cost of about 5 µs per
/// call loses to OpenBLAS (a decoded token's products: M = 1); measured 2026-12-03 on AMD EPYC Zen 5,
/// 2 threads, K = 128: OpenBLAS 0.3.21 (0.3.34) faster up to M·N·K = 2^18 at N = 128 (M = 16),
/// oneDNN faster from 2^19 (M = 32) and at N = 384, 512 from M = 4. The micro-kernels pack the
/// weight at every call, a fixed cost of the same kind; measured for them on 2026-12-04 (the same
/// CPU, a layer's forward and backward through linear(), best of 7): from 16 rows they beat OpenBLAS
/// with its Haswell and its Cooperlake kernels (K = 128 → 384: 57 µs against 107 and 69), below 8
/// rows OpenBLAS's Cooperlake kernels win (1 row: 35 against 22 µs) and at 8 rows it depends on the
/// shape (128 → 384: 41 against 56; 512 → 128: 57 against 39), so the same bounds serve both.
constexpr int64_t kGemmRouteFromMultiplyAdds = int64_t{1} << 19;
constexpr int64_t kGemmRouteFromRows = 4;

/// Which GEMM multiplies a linear layer's float32 operands outside autocast, for products of at
/// least kGemmRouteFromMultiplyAdds and kGemmRouteFromRows (smaller ones: LibTorch's):
enum class Float32Products {
  /// oneDNN's float32 GEMM, where the process has a oneDNN whose GEMM is signal-safe
  /// (kernels/linear/onednn_gemm.h: 3.11.2, 3.12 and later; Debian unstable's 3.12.1).
  OneDnn,
  /// qkv's float32 micro-kernels (kernels::linear::multiply_float32), where the tiled kernel's
  /// instruction set has them in vectors and there is no such oneDNN: an older one (Debian 12's
  /// 2.6.3, Debian 13's 3.7.2), or none qkv can see.
  MicroKernels,
  /// LibTorch's (at::addmm / at::linear: OpenBLAS on Debian): QKV_LINEAR_GEMM=libtorch, or plain
  /// C++ micro-kernels and no such oneDNN.
  LibTorch,
};
Float32Products float32_products();

/// Which GEMM multiplies a linear layer's operands under CPU autocast to bfloat16 (operands rounded
/// to bfloat16, sums in float32, the output in bfloat16), by the CPU's instructions as
/// kernels::tiled::usable_isa() reports them, for products of at least kGemmRouteFromMultiplyAdds as
/// in float32 (all sizes on the Float32 route); LibTorch's everywhere with QKV_LINEAR_GEMM=libtorch:
enum class Bfloat16Products {
  /// LibTorch's bfloat16 matmul (oneDNN's primitives). With AMX they multiply on the tiles, which
  /// oneDNN's GEMM API does not; on an Intel CPU with AVX512_BF16 but no AMX, vdpbf16ps multiplies
  /// no faster than float32 FMAs, so there is nothing to gain from another route (not measured).
  LibTorch,
  /// oneDNN's bfloat16 GEMM, where the CPU multiplies bfloat16 pairs natively without AMX (the tiled
  /// kernel's default instruction set is avx512_bf16: AMD Zen 4 and later). Measured on AMD EPYC Zen
  /// 5, 2 threads, 2026-12-03, the lm's products: oneDNN 2.6.3's dnnl_gemm_bf16bf16f32 at 680–850
  /// GFLOP/s, LibTorch 1.13's bfloat16 matmul (oneDNN's brgemm) 1.2–1.6× slower.
  OneDnnBfloat16,
  /// qkv's float32 micro-kernels on the operands rounded to bfloat16, widened back to float32 as they
  /// are packed, in cache (kernels::linear::Bfloat16Gemm::Float32; oneDNN's float32 GEMM where the
  /// micro-kernels are plain C++, and LibTorch's products where there is no oneDNN either), where
  /// the CPU has no bfloat16 instructions (AVX2 or AVX-512 without AVX512_BF16: AMD Zen 2 and 3,
  /// Intel before Cooper Lake). The vector micro-kernels need no oneDNN: a LibTorch whose oneDNN
  /// qkv cannot find (the official downloads link it in, hidden) takes this route too. There
  /// LibTorch's bfloat16 matmul is LibTorch's own loops on AVX2 (mkldnn's bfloat16 wants AVX-512):
  /// the lm's bf16-mixed step took 5.5 s against float32's 0.18 s on LibTorch 1.13 (AMD EPYC Zen 5
  /// made to look like an AVX2 CPU, docs/PERFORMANCE.md, 2026-12-03).
  Float32,
};
Bfloat16Products bfloat16_products();

/// x Wᵀ + b, the same values and gradients as at::linear, by the fastest route that takes it:
/// - on the CPU, for products of at least kGemmRouteFromMultiplyAdds and kGemmRouteFromRows: one GEMM for
///   the product and both gradients' products, on the input's rows side by side (a non-contiguous
///   input is made contiguous first, as at::linear does); second-order gradients (create_graph) on
///   LibTorch's differentiable ops. Float32 outside autocast, on float32_products() unless that is
///   LibTorch; under CPU autocast to bfloat16, on
///   bfloat16_products() unless that is LibTorch, float32 or bfloat16 inputs rounded to bfloat16 as
///   autocast does, accumulated in float32 with the bias added in float32, the output in bfloat16
///   (autocast's type for it), and each gradient computed in float32 and returned in its input's
///   type (a float32 weight's gradient is not rounded to bfloat16 on the way, as it is under
///   autocast's casts);
/// - any other input with 3 or more dimensions, contiguous: its rows side by side in one addmm with
///   the bias (what PyTorch's Python F.linear does on 2.x; the C++ frontend's nn::Linear multiplies
///   first and adds the bias in a second pass, which under bf16 autocast also converts: 3.0 of
///   68.8 ms of a bf16-mixed SelfAttention step at B=8 N=512 E=256 on LibTorch 1.13, 2026-12-01);
/// - everything else: at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace qkv::detail
