// Which instruction set the tiled kernel's block products run on: asked of the CPU (cpuid) and of
// the operating system (xgetbv: does it save the wide registers?) once per process, at run time,
// so that one build runs everywhere. Private to qkv.
#pragma once

#include <string>

namespace qkv::kernels::tiled {

/// The block products' instruction sets, each a superset of the one before.
enum class ProductIsa {
  Portable,    // plain C++ (the compiler's baseline vectors): every x86-64 and every other CPU
  Avx2,        // AVX2 + FMA (and F16C), 8 floats a register
  Avx512,      // AVX-512 F/BW/VL, 16 floats a register
  Avx512Bf16,  // and AVX512_BF16's vdpbf16ps: bfloat16 pairs multiplied, summed in float32
  AmxBf16,     // and AMX-BF16's tiles (TDPBF16PS) for the bfloat16 products, where the kernel grants them
};

/// Whether `isa` includes `floor` (each instruction set includes the ones listed before it).
inline bool at_least(ProductIsa isa, ProductIsa floor) { return static_cast<int>(isa) >= static_cast<int>(floor); }

/// What this CPU and operating system can run.
ProductIsa detected_isa();

/// Who made the CPU (cpuid's vendor string), where that decides between two paths it can run.
enum class CpuVendor { Intel, Amd, Other };
CpuVendor cpu_vendor();

/// The instruction set the kernel takes by default where `detected` is what the CPU can run: that
/// one, except on an Intel CPU whose best is avx512_bf16 (AVX512_BF16 without AMX: Cooper Lake, or a
/// later Xeon whose AMX the hypervisor or the kernel withholds), which gets avx512: there vdpbf16ps
/// multiplies no more pairs per cycle than two FMA ports multiply float32 values, and the bfloat16
/// core on it was measured 1.24-1.31× slower than on the float32 micro-kernels with its values
/// widened (Intel Xeon with AMX, QKV_TILED_ISA=avx512_bf16 against avx512, 2026-12-02), where AMD
/// Zen 4's was 1.4-1.7× faster than float32 (docs/PERFORMANCE.md).
ProductIsa default_isa(ProductIsa detected, CpuVendor vendor);

/// What the kernel uses: default_isa(detected_isa(), cpu_vendor()), or the instruction set the
/// environment variable QKV_TILED_ISA names (portable, avx2, avx512, avx512_bf16, amx_bf16) when
/// set, so that tests and benchmarks can run every path the CPU can: the narrower ones, and
/// avx512_bf16 on an Intel CPU. A value naming more than the CPU has is capped at what it has; an
/// unknown value is an error naming the accepted ones. Read once.
ProductIsa active_isa();

/// What the CPU can run as qkv sees it: detected_isa(), or as QKV_TILED_ISA lowers it when set
/// (without default_isa's choice for Intel). Other routes that depend on the CPU's bfloat16
/// instructions (the linear layers', src/linear.h) ask this, so that one variable makes a CPU look
/// like a narrower one to all of qkv.
ProductIsa usable_isa();

/// Whether LibTorch's bfloat16 matrix products and GELU run on its own loops here rather than on
/// oneDNN: oneDNN's bfloat16 wants AVX-512 (LibTorch's mkldnn_bf16_device_check: AVX512BW, VL and
/// DQ), so on a CPU without it, as usable_isa() sees it, they are LibTorch's element-at-a-time code
/// (a 16 × 128 × 384 bfloat16 product 24× slower than float32's, LibTorch 1.13). Where this holds qkv
/// keeps bfloat16 work off those paths (src/linear.h, src/activation.h, the backend of a decoded
/// token in src/functional.cpp).
bool libtorch_bfloat16_on_own_loops();

/// "portable", "avx2", "avx512", "avx512_bf16", "amx_bf16".
const char* isa_name(ProductIsa isa);

/// The CPU's flags that matter to the kernel, as /proc/cpuinfo names them, space-separated
/// (e.g. "avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16").
std::string cpu_flags();

}  // namespace qkv::kernels::tiled
