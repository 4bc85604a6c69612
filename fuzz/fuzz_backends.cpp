// libFuzzer target: bytes decoded into a case of the attention core (shapes, grouped heads,
// causal, masks, layouts, dtypes; tests/support/attention_cases.h, as the differential test draws
// them) and run by every backend against the float64 math path, with gradients or (one in four)
// forward only, without them (a decoded token's sometimes against a long cache). Auto must agree; a backend chosen
// by name may refuse with a c10::Error. A disagreement aborts (a finding); keep the input in
// fuzz/corpus/backends, where tests/test_backends_agree.cpp replays it.
#include "support/attention_cases.h"

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool single_threaded = [] {
    at::set_num_threads(1);  // one case at a time, small: threads cost more than they give
    return true;
  }();
  (void)single_threaded;
  qkv_test::ByteChooser chooser(data, size);
  auto c = qkv_test::draw_case(chooser, /*max_positions=*/80);
  const auto passes = qkv_test::draw_passes(chooser);
  qkv_test::draw_long_keys(chooser, c, passes);
  const auto report = qkv_test::check_case(c, passes);
  if (!report.empty()) {
    std::fprintf(stderr, "backends disagree: %s\n", report.c_str());
    std::abort();
  }
  return 0;
}
