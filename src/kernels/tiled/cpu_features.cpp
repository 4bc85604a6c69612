#include "kernels/tiled/cpu_features.h"

#include "kernels/tiled/amx_products.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define QKV_X86 1
#endif

namespace qkv::kernels::tiled {
namespace {

struct Flags {
  bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512dq = false, avx512bw = false,
       avx512vl = false, avx512_bf16 = false, amx_bf16 = false, amx_tile = false;
};

#if defined(QKV_X86)
// XCR0: which register states the operating system saves on a context switch. Without its say-so
// a CPU's AVX or AVX-512 registers must not be used, whatever cpuid reports.
uint64_t os_saved_state() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

Flags read_flags() {
  Flags f;
#if defined(QKV_X86)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return f;
  const bool osxsave = (ecx >> 27) & 1;
  const bool fma = (ecx >> 12) & 1;
  const bool f16c = (ecx >> 29) & 1;
  if (!osxsave) return f;
  const uint64_t xcr0 = os_saved_state();
  const bool ymm_saved = (xcr0 & 0x6) == 0x6;     // SSE and AVX state
  const bool zmm_saved = (xcr0 & 0xE6) == 0xE6;   // and opmask, upper 256 bits, 16 more registers
  const bool tiles_saved = (xcr0 & 0x60000) == 0x60000;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return f;
  f.avx2 = ymm_saved && ((ebx >> 5) & 1);
  f.fma = ymm_saved && fma;
  f.f16c = ymm_saved && f16c;
  f.avx512f = zmm_saved && ((ebx >> 16) & 1);
  f.avx512dq = zmm_saved && ((ebx >> 17) & 1);
  f.avx512bw = zmm_saved && ((ebx >> 30) & 1);
  f.avx512vl = zmm_saved && ((ebx >> 31) & 1);
  f.amx_bf16 = tiles_saved && ((edx >> 22) & 1);
  f.amx_tile = tiles_saved && ((edx >> 24) & 1);
  unsigned leaf7_max = eax;
  if (leaf7_max >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0) {
    f.avx512_bf16 = zmm_saved && ((eax >> 5) & 1);
  }
#endif
  return f;
}

const Flags& flags() {
  static const Flags cached = read_flags();
  return cached;
}

ProductIsa parse_isa(std::string_view name) {
  for (auto isa : {ProductIsa::Portable, ProductIsa::Avx2, ProductIsa::Avx512, ProductIsa::Avx512Bf16,
                   ProductIsa::AmxBf16}) {
    if (name == isa_name(isa)) return isa;
  }
  TORCH_CHECK(false, "QKV_TILED_ISA: expected one of portable, avx2, avx512, avx512_bf16, amx_bf16, got '", name, "'");
}

}  // namespace

ProductIsa detected_isa() {
  const Flags& f = flags();
  // F16C converts float16 blocks to and from float32 (vector_math.cpp); every CPU with AVX2 and
  // FMA has it, and one without it is given the portable paths.
  if (!(f.avx2 && f.fma && f.f16c)) return ProductIsa::Portable;
  if (!(f.avx512f && f.avx512bw && f.avx512vl)) return ProductIsa::Avx2;
  // The bfloat16 paths' exponential takes AVX512DQ's vreduceps (vector_math.cpp): every CPU with
  // AVX512_BF16 has it, and one without it is given the float32 paths.
  if (!(f.avx512_bf16 && f.avx512dq)) return ProductIsa::Avx512;
  // AMX's registers need the kernel's leave per process (Linux 5.16 on); asked once.
  static const bool tiles_granted = f.amx_tile && f.amx_bf16 && amx::request_tile_permission();
  return tiles_granted ? ProductIsa::AmxBf16 : ProductIsa::Avx512Bf16;
}

CpuVendor cpu_vendor() {
#if defined(QKV_X86)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return CpuVendor::Other;
  char name[13] = {};
  std::memcpy(name, &ebx, 4), std::memcpy(name + 4, &edx, 4), std::memcpy(name + 8, &ecx, 4);
  const std::string_view vendor(name, 12);
  if (vendor == "GenuineIntel") return CpuVendor::Intel;
  if (vendor == "AuthenticAMD") return CpuVendor::Amd;
#endif
  return CpuVendor::Other;
}

ProductIsa default_isa(ProductIsa detected, CpuVendor vendor) {
  if (detected == ProductIsa::Avx512Bf16 && vendor == CpuVendor::Intel) return ProductIsa::Avx512;
  return detected;
}

namespace {

// QKV_TILED_ISA's instruction set, capped at what the CPU has; none when it is not set.
std::optional<ProductIsa> requested_isa() {
  static const std::optional<ProductIsa> requested = []() -> std::optional<ProductIsa> {
    const char* name = std::getenv("QKV_TILED_ISA");
    if (name == nullptr || *name == '\0') return std::nullopt;
    const ProductIsa wanted = parse_isa(name), detected = detected_isa();
    return at_least(detected, wanted) ? wanted : detected;
  }();
  return requested;
}

}  // namespace

ProductIsa usable_isa() { return requested_isa().value_or(detected_isa()); }

bool libtorch_bfloat16_on_own_loops() { return !at_least(usable_isa(), ProductIsa::Avx512); }

ProductIsa active_isa() {
  static const ProductIsa chosen = requested_isa().value_or(default_isa(detected_isa(), cpu_vendor()));
  return chosen;
}

const char* isa_name(ProductIsa isa) {
  switch (isa) {
    case ProductIsa::Portable: return "portable";
    case ProductIsa::Avx2: return "avx2";
    case ProductIsa::Avx512: return "avx512";
    case ProductIsa::Avx512Bf16: return "avx512_bf16";
    case ProductIsa::AmxBf16: return "amx_bf16";
  }
  return "unknown";
}

std::string cpu_flags() {
  const Flags& f = flags();
  std::string out;
  auto add = [&](bool present, const char* name) {
    if (!present) return;
    if (!out.empty()) out += ' ';
    out += name;
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512dq, "avx512dq");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.amx_tile, "amx_tile");
  add(f.amx_bf16, "amx_bf16");
  return out;
}

}  // namespace qkv::kernels::tiled
