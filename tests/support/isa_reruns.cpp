// The ctest commands that rerun cases under a QKV_TILED_ISA cap (kernel.isa_*, routes.isa_* in
// tests/CMakeLists.txt) exist for the paths the plain run does not take on this CPU. Where the cap
// leaves qkv's choices as the plain run has them (kernel.isa_avx512_bf16 on an AMD Zen 4 or 5,
// whose default that is; a name above what the CPU has, capped down to its default), the rerun
// would repeat the plain run's cases on the same code, which under the sanitizers takes minutes.
// Those commands set QKV_TEST_SKIP_PLAIN_ISA=1, and then the whole run is skipped, saying why.
#include "kernels/tiled/cpu_features.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace {

using qkv::kernels::tiled::active_isa;
using qkv::kernels::tiled::cpu_vendor;
using qkv::kernels::tiled::default_isa;
using qkv::kernels::tiled::detected_isa;
using qkv::kernels::tiled::isa_name;
using qkv::kernels::tiled::usable_isa;

class SkipThePlainRunsIsa : public testing::Environment {
 public:
  void SetUp() override {
    const char* asked = std::getenv("QKV_TEST_SKIP_PLAIN_ISA");
    if (asked == nullptr || std::strcmp(asked, "1") != 0) return;
    // The plain run's choices: the tiled kernel's (active_isa) and every other route's (usable_isa).
    const auto plain_active = default_isa(detected_isa(), cpu_vendor());
    if (active_isa() == plain_active && usable_isa() == detected_isa()) {
      const char* cap = std::getenv("QKV_TILED_ISA");
      GTEST_SKIP() << "skipped: QKV_TILED_ISA=" << (cap != nullptr ? cap : "(unset)") << " leaves qkv on "
                   << isa_name(active_isa()) << " as the plain run on this CPU (" << isa_name(detected_isa())
                   << "): no path of its own to test";
    }
  }
};

[[maybe_unused]] testing::Environment* const kSkipThePlainRunsIsa =
    testing::AddGlobalTestEnvironment(new SkipThePlainRunsIsa);

}  // namespace
