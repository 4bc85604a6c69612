// libFuzzer target: arbitrary bytes as a weights file. Reading and loading them must either work
// or throw c10::Error; a crash, a hang or a sanitizer report is a bug (turn it into a test).
#include <qkv/qkv.h>

#include <cstddef>
#include <cstdint>
#include <vector>

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
