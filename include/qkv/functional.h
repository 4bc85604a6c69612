// The functional core: scaled dot-product attention, the free function SelfAttention calls.
//
// Dimension legend used in qkv's comments:
//   B = batch, H = query heads, Hkv = key/value heads, N = query positions, S = key/value
//   positions, E = d_model, D = head width (E / H), Dv = value head width.
#pragma once

#include <string>

#include <qkv/options.h>

#include <torch/types.h>

namespace qkv {

struct AttentionResult {
  torch::Tensor output;   // (..., N, Dv)
  torch::Tensor weights;  // (..., N, S), rows sum to 1 (0 for fully masked rows); undefined unless asked
  AttentionBackend backend = AttentionBackend::Math;  // the backend that ran (never Auto)
};

/// softmax(q kᵀ · scale + mask) v for q (..., N, D), k (..., S, D), v (..., S, Dv), where the
/// leading dimensions of q, k and v are equal (with `enable_gqa`, k and v may have fewer heads in
/// dimension -3). A query row whose keys are all masked gets a zero output and zero gradients,
/// never NaN. Throws c10::Error naming the argument for inputs that do not fit.
AttentionResult scaled_dot_product_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const ScaledDotProductAttentionOptions& options = {});

/// The backend scaled_dot_product_attention runs for inputs of these shapes, dtype and device
/// with these options (Auto resolved): what ran can be reported without keeping any state. Only
/// the tensors' metadata is read (shapes, dtype, device, and whether q, k or the mask require
/// grad: v is taken to require it as k does).
AttentionBackend choose_backend(const torch::Tensor& q, const torch::Tensor& k,
                                const ScaledDotProductAttentionOptions& options);

/// The instruction set the tiled CPU backend's block products run on in this process, chosen at
/// run time from the CPU: "amx_bf16" (bfloat16 inputs multiply on AMX tiles), "avx512_bf16"
/// (bfloat16 inputs multiply as bfloat16 pairs, vdpbf16ps), "avx512", "avx2" (with FMA) or
/// "portable". The environment variable QKV_TILED_ISA, read once, lowers it (to compare paths, or
/// to rule one out), and with it the bfloat16 route of the linear layers (linear_products()).
std::string tiled_instruction_set();

/// Which library multiplies qkv's linear layers on the CPU (W_q, W_k, W_v, W_o, the
/// TransformerBlock's MLP), float32 first: "oneDNN 3.12.1" where the process has LibTorch's oneDNN
/// (Debian's LibTorch links it) and its float32 GEMM is signal-safe (oneDNN 3.11.2, 3.12 and
/// later), which qkv calls for the forward and both gradients' products; "qkv's float32
/// micro-kernels (why)" where it is not (Debian 12's 2.6.3 and 13's 3.7.2: a signal handled during
/// one of its products corrupted the heap, oneDNN issue #4845) or qkv finds none, and the tiled
/// kernel's instruction set has vector micro-kernels (AVX2 and up); otherwise "LibTorch's (why)":
/// at::addmm / at::linear, OpenBLAS on Debian. Then bfloat16 autocast's route: " (bfloat16
/// autocast too)" or "; bfloat16 autocast on oneDNN 2.6.3's bfloat16 GEMM" where its products go
/// to oneDNN's bfloat16 GEMM (a CPU with AVX512_BF16 and no AMX: AMD Zen 4 and later); " (bfloat16
/// autocast too, on qkv's float32 micro-kernels: no bfloat16 instructions)" or "; bfloat16
/// autocast on qkv's float32 micro-kernels (no bfloat16 instructions)" where they go to qkv's own
/// float32 micro-kernels on the operands rounded to bfloat16 (a CPU without AVX512_BF16 and AMX,
/// where LibTorch's bfloat16 products are its own slow loops); nothing where LibTorch's bfloat16
/// products take them (AMX). The environment variable QKV_LINEAR_GEMM, read once, compares:
/// "libtorch" keeps every product on LibTorch's, "no-onednn" does as if the process had no oneDNN;
/// any other value is refused (c10::Error naming the accepted ones) by the first linear layer.
/// Products under 2^19 multiply-adds or 4 rows (a decoded token's), float16 and float64, and other
/// devices always use LibTorch's.
std::string linear_products();

/// The CPU OpenBLAS chose its kernels for ("SkylakeX", "Cooperlake", "Zen", ...; "" without
/// OpenBLAS). Debian's LibTorch multiplies float32 matrices with the same OpenBLAS.
std::string blas_core();

/// "" unless OpenBLAS fell back to its generic kernels on a CPU with AVX2 or more (Debian 12's
/// OpenBLAS 0.3.21 takes an Intel Xeon of the Emerald Rapids generation for a "Prescott", and its
/// float32 products run at 29 instead of about 150-220 GFLOP/s on 2 cores); else one line saying
/// so and which OPENBLAS_CORETYPE to run with (the variable is read when OpenBLAS loads, before
/// any of qkv's code runs, so a program cannot set it for itself).
std::string blas_core_advice();

}  // namespace qkv
