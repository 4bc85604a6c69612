// A program that uses qkv the way an embedding project does; built by tests/consumers/* against
// an installed qkv (find_package) and through add_subdirectory. Exits non-zero when the forward
// pass or the version header does not behave.
#include <qkv/qkv.h>

#include <torch/torch.h>

#include <cstdio>

int main() {
  torch::manual_seed(0);
  qkv::SelfAttention attention(qkv::SelfAttentionOptions(16).num_heads(4).causal(true));
  auto x = torch::randn({2, 5, 16});  // (B, N, E)
  auto result = attention->forward_with_weights(x);
  const bool shapes_ok = result.output.sizes() == x.sizes() &&
                         result.weights.sizes() == c10::IntArrayRef({2, 4, 5, 5});
  const bool rows_ok = torch::allclose(result.weights.sum(-1), torch::ones({2, 4, 5}));
  std::printf("qkv %s: output %s, weights rows sum to 1: %s\n", QKV_VERSION_STRING, shapes_ok ? "ok" : "WRONG",
              rows_ok ? "yes" : "NO");
  return shapes_ok && rows_ok ? 0 : 1;
}
