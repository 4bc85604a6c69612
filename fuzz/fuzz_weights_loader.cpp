// libFuzzer target: arbitrary bytes as a weights file. Reading and loading them must either work
// or throw c10::Error; a crash, a hang or a sanitizer report is a bug (turn it into a test).
//
// Two kinds of mutation, half the time each (fuzz/archive_mutator.h). libFuzzer's own, on the
// file's bytes, found the faults in the zip records (src/archive_integrity.cpp). But a mutated byte
// inside an entry fails that entry's CRC-32 and stops there, so the pickle and the tensors behind it
// were seldom reached (once in 1.3 million runs). The other mutation rewrites one entry (most often
// the pickle) with the CRCs right. Within seconds it found LibTorch 1.13's unpickler writing through a
// wild pointer (tests/data/fuzz_regressions/weights_pickle_tuple3_on_a_short_stack.pt), which led
// to qkv reading the pickle itself (src/pickle_reader.cpp).
#include "archive_mutator.h"

#include <qkv/qkv.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  // The pickle three times in four, else any entry (a tensor's bytes, the version).
  return qkv_fuzz::mutate_archive(data, size, max_size, seed,
                                  [](const std::string& name) { return qkv_fuzz::ends_with(name, ".pkl"); });
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static qkv::SelfAttention module(qkv::SelfAttentionOptions(8).num_heads(2).out_proj(true));
  const std::vector<char> bytes(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  try {
    const auto tensors = qkv::read_tensor_dict(bytes, "fuzz input");
    qkv::load_state_dict(module, tensors, "fuzz input");
  } catch (const c10::Error&) {
    // refused with a message: the expected outcome for damaged input
  }
  return 0;
}
