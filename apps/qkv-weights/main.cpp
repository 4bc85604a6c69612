// qkv-weights: PyTorch weight files and qkv. Exit status: 0 done, 1 failure, 2 bad command line.
//   qkv-weights inspect FILE                      keys, shapes and the layout qkv recognises
//   qkv-weights convert IN OUT [--heads H]         any recognised layout -> qkv's (the documents' keys)
//   qkv-weights forward WEIGHTS INPUT OUTPUT ...   run SelfAttention with WEIGHTS on INPUT["query"]
//                                                  (INPUT["context"] optional), write {"output": ...}
// The module's shape comes from the weights (d_model, kdim, vdim, bias, W_o); the number of heads
// cannot be read from weights and is given with --heads.
#include <qkv/qkv.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>

namespace {

// SelfAttentionOptions that fit `tensors` (after mapping nn.MultiheadAttention's names).
qkv::SelfAttentionOptions options_for(const std::map<std::string, torch::Tensor>& tensors, int64_t heads) {
  const bool multihead = qkv::detect_layout(tensors) == qkv::StateDictLayout::MultiheadAttention;
  auto find = [&](const std::string& key) -> torch::Tensor {
    auto it = tensors.find(key);
    return it == tensors.end() ? torch::Tensor() : it->second;
  };
  torch::Tensor query_weight, key_weight, value_weight;
  if (multihead && find("in_proj_weight").defined()) {
    const auto parts = find("in_proj_weight").chunk(3);
    query_weight = parts[0], key_weight = parts[1], value_weight = parts[2];
  } else if (multihead) {
    query_weight = find("q_proj_weight"), key_weight = find("k_proj_weight"), value_weight = find("v_proj_weight");
  } else {
    query_weight = find("W_q.weight"), key_weight = find("W_k.weight"), value_weight = find("W_v.weight");
  }
  if (!query_weight.defined() || !key_weight.defined() || !value_weight.defined() || query_weight.dim() != 2 ||
      key_weight.dim() != 2 || value_weight.dim() != 2) {
    throw std::runtime_error("no W_q/W_k/W_v (or in_proj_weight) matrices found; see `qkv-weights inspect`");
  }
  const bool bias = multihead ? find("in_proj_bias").defined() : find("W_q.bias").defined();
  const bool out_proj = multihead ? find("out_proj.weight").defined() : find("W_o.weight").defined();
  return qkv::SelfAttentionOptions(query_weight.size(0))
      .num_heads(heads)
      .bias(bias)
      .out_proj(out_proj)
      .kdim(key_weight.size(1))
      .vdim(value_weight.size(1));
}

// The tensors of a torch.save'd dict, ignoring entries that are not tensors.
std::map<std::string, torch::Tensor> read_inputs(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto value = torch::pickle_load(bytes);
  if (!value.isGenericDict()) throw std::runtime_error(path + " is not a dict");
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& entry : value.toGenericDict()) {
    if (entry.key().isString() && entry.value().isTensor()) {
      tensors.emplace(entry.key().toStringRef(), entry.value().toTensor());
    }
  }
  return tensors;
}

qkv::SelfAttention load(const std::string& path, int64_t heads) {
  const auto tensors = qkv::read_tensor_dict(path);
  qkv::SelfAttention module(options_for(tensors, heads));
  qkv::load_state_dict(module, tensors, path);
  return module;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv-weights: PyTorch weight files and qkv::SelfAttention", "qkv-weights"};
  app.require_subcommand(1);
  int64_t heads = 1;
  bool causal = false;
  std::string in, out, input, output;

  auto* inspect = app.add_subcommand("inspect", "Keys, shapes and the layout qkv recognises");
  inspect->add_option("FILE", in, "A file written by torch.save")->required()->check(CLI::ExistingFile);

  auto* convert = app.add_subcommand("convert", "Rewrite weights in qkv's layout (the documents' key names)");
  convert->add_option("IN", in, "Weights (documents' or nn.MultiheadAttention layout)")->required()->check(CLI::ExistingFile);
  convert->add_option("OUT", out, "Output file")->required();
  convert->add_option("--heads", heads, "Heads of the module")->check(CLI::Range(int64_t{1}, int64_t{4096}));

  auto* forward = app.add_subcommand("forward", "Run the module on INPUT[\"query\"] and write {\"output\": ...}");
  forward->add_option("WEIGHTS", in, "Weights file")->required()->check(CLI::ExistingFile);
  // LibTorch 1.13 cannot unpickle a one-entry dict (opcode SETITEM): add any second entry.
  forward->add_option("INPUT", input, "torch.save'd dict with \"query\" (and optional \"context\"), 2+ entries")
      ->required()
      ->check(CLI::ExistingFile);
  forward->add_option("OUTPUT", output, "Output file (torch.load reads it)")->required();
  forward->add_option("--heads", heads, "Heads of the module")->check(CLI::Range(int64_t{1}, int64_t{4096}));
  forward->add_flag("--causal", causal, "Causal mask");
  forward->add_option("--save-weights", out, "Also write the loaded weights in qkv's layout");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    std::fprintf(stderr, "qkv-weights: error: %s (see --help)\n", what.c_str());
    return 2;
  }

  try {
    if (inspect->parsed()) {
      const auto tensors = qkv::read_tensor_dict(in);
      const bool multihead = qkv::detect_layout(tensors) == qkv::StateDictLayout::MultiheadAttention;
      std::printf("%s: %s layout, %zu tensors\n", in.c_str(), multihead ? "nn.MultiheadAttention" : "documents'",
                  tensors.size());
      for (const auto& [key, tensor] : tensors) {
        std::ostringstream shape;
        shape << tensor.sizes();
        std::printf("  %-16s %-12s %s\n", key.c_str(), shape.str().c_str(), c10::toString(tensor.scalar_type()));
      }
    } else if (convert->parsed()) {
      qkv::save_state_dict(load(in, heads), out);
    } else {
      auto module = load(in, heads);
      module->options.causal(causal);
      const auto inputs = read_inputs(input);
      if (!inputs.count("query")) throw std::runtime_error(input + " has no \"query\" tensor");
      const auto context = inputs.count("context") ? inputs.at("context") : torch::Tensor();
      torch::NoGradGuard no_grad;
      const auto result = module(inputs.at("query").to(module->W_q->weight.scalar_type()),
                                 context.defined() ? context.to(module->W_q->weight.scalar_type()) : context);
      qkv::save_tensor_dict({{"output", result}}, output);
      if (!out.empty()) qkv::save_state_dict(module, out);
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
