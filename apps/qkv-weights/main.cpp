// qkv-weights: PyTorch weight files and qkv. Exit status: 0 done, 1 failure, 2 bad command line.
//   qkv-weights inspect FILE                      keys, shapes and the layout qkv recognises
//   qkv-weights convert IN OUT [--heads H]         any recognised layout -> qkv's (the documents' keys)
//   qkv-weights forward WEIGHTS INPUT OUTPUT ...   run SelfAttention with WEIGHTS on INPUT["query"]
//                                                  (INPUT["context"] optional), write {"output": ...}
// The module's shape comes from the weights (d_model, key/value heads relative to the query
// heads, kdim, vdim, bias, W_o; a TransformerBlock's MLP width); the number of heads cannot be
// read from weights and is given with --heads.
#include "common/cli_support.h"
#include "torch_file.h"

#include <qkv/qkv.h>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <cstdio>

namespace {

torch::Tensor find(const std::map<std::string, torch::Tensor>& tensors, const std::string& key) {
  auto it = tensors.find(key);
  return it == tensors.end() ? torch::Tensor() : it->second;
}

// Key/value heads from the widths of W_q (H·D) and W_k (Hkv·D): unset when they are equal.
c10::optional<int64_t> kv_heads_for(const torch::Tensor& query_weight, const torch::Tensor& key_weight, int64_t heads) {
  const auto query_width = query_weight.size(0), key_width = key_weight.size(0);
  if (key_width == query_width) return c10::nullopt;
  if (query_width % heads != 0 || key_width % (query_width / heads) != 0) {
    throw std::runtime_error("W_k's width " + std::to_string(key_width) + " is not a whole number of heads of width " +
                             std::to_string(query_width / heads) + " (d_model " + std::to_string(query_width) +
                             " / --heads " + std::to_string(heads) + ")");
  }
  return key_width / (query_width / heads);
}

// SelfAttentionOptions that fit `tensors` (either attention layout).
qkv::SelfAttentionOptions options_for(const std::map<std::string, torch::Tensor>& tensors, int64_t heads) {
  const auto mapped = qkv::to_documents_layout(tensors);
  const auto query_weight = find(mapped, "W_q.weight"), key_weight = find(mapped, "W_k.weight");
  const auto value_weight = find(mapped, "W_v.weight");
  if (!query_weight.defined() || !key_weight.defined() || !value_weight.defined() || query_weight.dim() != 2 ||
      key_weight.dim() != 2 || value_weight.dim() != 2) {
    throw std::runtime_error("no W_q/W_k/W_v (or in_proj_weight) matrices found; see `qkv-weights inspect`");
  }
  return qkv::SelfAttentionOptions(query_weight.size(0))
      .num_heads(heads)
      .num_kv_heads(kv_heads_for(query_weight, key_weight, heads))
      .bias(find(mapped, "W_q.bias").defined())
      .out_proj(find(mapped, "W_o.weight").defined())
      .kdim(key_weight.size(1))
      .vdim(value_weight.size(1));
}

// TransformerBlockOptions that fit a block's `tensors` (ln_1.*, attn.*, mlp_fc.*, mlp_proj.*).
qkv::TransformerBlockOptions block_options_for(const std::map<std::string, torch::Tensor>& tensors, int64_t heads,
                                               bool causal, bool rope) {
  const auto query_weight = find(tensors, "attn.W_q.weight"), key_weight = find(tensors, "attn.W_k.weight");
  const auto fc_weight = find(tensors, "mlp_fc.weight");
  if (!query_weight.defined() || !key_weight.defined() || !fc_weight.defined() || query_weight.dim() != 2 ||
      fc_weight.dim() != 2 || fc_weight.size(0) % query_weight.size(0) != 0) {
    throw std::runtime_error(
        "not a TransformerBlock's weights (attn.W_q.weight, attn.W_k.weight, mlp_fc.weight); "
        "see `qkv-weights inspect`");
  }
  return qkv::TransformerBlockOptions(query_weight.size(0), heads)
      .num_kv_heads(kv_heads_for(query_weight, key_weight, heads))
      .mlp_ratio(fc_weight.size(0) / query_weight.size(0))
      .bias(find(tensors, "attn.W_q.bias").defined())
      .causal(causal)
      .rope(rope);
}

// The tensors of a torch.save'd dict; other entries (notes, numbers) are left out.
std::map<std::string, torch::Tensor> read_inputs(const std::string& path) {
  const auto value =
      qkv::detail::read_torch_file(qkv::detail::read_file_bytes(path, "qkv-weights"), path, "qkv-weights");
  if (!value.isGenericDict()) throw std::runtime_error(path + " holds a " + value.tagKind() + ", not a dict");
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& entry : value.toGenericDict()) {
    if (entry.key().isString() && entry.value().isTensor()) {
      tensors.emplace(entry.key().toStringRef(), entry.value().toTensor());
    }
  }
  return tensors;
}

// A module for the weights of `path`: a SelfAttention or a TransformerBlock, by their layout.
torch::nn::AnyModule load(const std::string& path, int64_t heads, bool causal, bool rope) {
  const auto tensors = qkv::read_tensor_dict(path);
  if (qkv::detect_layout(tensors) == qkv::StateDictLayout::TransformerBlock) {
    qkv::TransformerBlock block(block_options_for(tensors, heads, causal, rope));
    qkv::load_state_dict(block, tensors, path);
    return torch::nn::AnyModule(block);
  }
  qkv::SelfAttention module(options_for(tensors, heads).causal(causal).rope(rope));
  qkv::load_state_dict(module, tensors, path);
  return torch::nn::AnyModule(module);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv-weights: PyTorch weight files and qkv::SelfAttention", "qkv-weights"};
  app.require_subcommand(1);
  int64_t heads = 1;
  bool causal = false, rope = false;
  std::string in, out, input, output;

  auto* inspect = app.add_subcommand("inspect", "Keys, shapes and the layout qkv recognises");
  inspect->add_option("FILE", in, "A file written by torch.save")->required()->check(CLI::ExistingFile);

  auto* convert = app.add_subcommand("convert", "Rewrite weights in qkv's layout (the documents' key names)");
  convert->add_option("IN", in, "Weights (documents' or nn.MultiheadAttention layout)")
      ->required()
      ->check(CLI::ExistingFile);
  convert->add_option("OUT", out, "Output file")->required();
  convert->add_option("--heads", heads, "Heads of the module")->check(CLI::Range(int64_t{1}, int64_t{4096}));

  auto* forward = app.add_subcommand("forward",
                                     "Run the module (SelfAttention or TransformerBlock) on "
                                     "INPUT[\"query\"] and write {\"output\": ...}");
  forward->add_option("WEIGHTS", in, "Weights file")->required()->check(CLI::ExistingFile);
  forward->add_option("INPUT", input, "torch.save'd dict with \"query\" (and optional \"context\")")
      ->required()
      ->check(CLI::ExistingFile);
  forward->add_option("OUTPUT", output, "Output file (torch.load reads it)")->required();
  forward->add_option("--heads", heads, "Heads of the module")->check(CLI::Range(int64_t{1}, int64_t{4096}));
  forward->add_flag("--causal", causal, "Causal mask");
  forward->add_flag("--rope", rope, "Rotary positions (they have no weights, so the file cannot say)");
  forward->add_option("--save-weights", out, "Also write the loaded weights in qkv's layout");

  if (const auto exit_code = qkv_cli::parse(app, argc, argv)) return *exit_code;

  try {
    if (inspect->parsed()) {
      const auto tensors = qkv::read_tensor_dict(in);
      std::printf("%s: %s layout, %zu tensor%s\n", in.c_str(), qkv::to_string(qkv::detect_layout(tensors)),
                  tensors.size(), tensors.size() == 1 ? "" : "s");
      for (const auto& [key, tensor] : tensors) {
        std::ostringstream shape;
        shape << tensor.sizes();
        std::printf("  %-16s %-12s %s\n", key.c_str(), shape.str().c_str(), c10::toString(tensor.scalar_type()));
      }
    } else if (convert->parsed()) {
      qkv::save_state_dict(*load(in, heads, /*causal=*/false, /*rope=*/false).ptr(), out);
    } else {
      auto module = load(in, heads, causal, rope);
      const auto inputs = read_inputs(input);
      if (!inputs.count("query")) throw std::runtime_error(input + " has no \"query\" tensor");
      const auto dtype = module.ptr()->parameters().front().scalar_type();
      const auto query = inputs.at("query").to(dtype);
      torch::NoGradGuard no_grad;
      torch::Tensor result;
      if (inputs.count("context")) {
        auto* attention = module.ptr()->as<qkv::SelfAttentionImpl>();
        if (attention == nullptr)
          throw std::runtime_error("a TransformerBlock takes no \"context\" (self-attention only)");
        result = attention->forward(query, inputs.at("context").to(dtype));
      } else {
        result = module.forward(query);
      }
      qkv::save_tensor_dict({{"output", result}}, output);
      if (!out.empty()) qkv::save_state_dict(*module.ptr(), out);
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "qkv-weights: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv-weights: %s\n", e.what());
    return 1;
  }
  return 0;
}
