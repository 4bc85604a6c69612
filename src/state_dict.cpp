// PyTorch weight files: reading torch.save'd dicts, mapping nn.MultiheadAttention's layout onto
// SelfAttention's parameters, validating everything before changing anything, and writing files
// that Python's torch.load reads.
#include <qkv/state_dict.h>

#include "atomic_file.h"
#include "torch_file.h"

#include <torch/torch.h>

#include <sstream>

namespace qkv {
namespace {

std::string join(const std::vector<std::string>& items) {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : ", ") + item;
  return text;
}

std::string shape_text(c10::IntArrayRef sizes) {
  std::ostringstream text;
  text << sizes;
  return text.str();
}

}  // namespace

const char* to_string(StateDictLayout layout) {
  switch (layout) {
    case StateDictLayout::Documents:
      return "documents'";
    case StateDictLayout::MultiheadAttention:
      return "nn.MultiheadAttention";
    case StateDictLayout::TransformerBlock:
      return "TransformerBlock";
  }
  return "unknown";
}

std::map<std::string, torch::Tensor> read_tensor_dict(const std::string& path) {
  return read_tensor_dict(detail::read_file_bytes(path, "load_state_dict"), path);
}

std::map<std::string, torch::Tensor> read_tensor_dict(const std::vector<char>& bytes, const std::string& path) {
  // Refusals name the file: "load_state_dict: <path>: ...". An OrderedDict (Python's
  // model.state_dict()) reads as a dict.
  const c10::IValue value = detail::read_torch_file(bytes, path, "load_state_dict");
  TORCH_CHECK(value.isGenericDict(), "load_state_dict: ", path, " holds a ", value.tagKind(),
              "; expected a dict of tensors as written by torch.save(model.state_dict(), path)");
  std::map<std::string, torch::Tensor> tensors;
  std::vector<std::string> not_tensors;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK(entry.key().isString(), "load_state_dict: ", path, " has a key of type ", entry.key().tagKind(),
                "; expected parameter names (strings)");
    if (!entry.value().isTensor()) {
      not_tensors.push_back(entry.key().toStringRef() + " (" + entry.value().tagKind() + ")");
      continue;
    }
    tensors.emplace(entry.key().toStringRef(), entry.value().toTensor());
  }
  TORCH_CHECK(not_tensors.empty(), "load_state_dict: ", path, " has entries that are not tensors: ", join(not_tensors));
  return tensors;
}

StateDictLayout detect_layout(const std::map<std::string, torch::Tensor>& tensors) {
  for (const char* key : {"in_proj_weight", "q_proj_weight", "out_proj.weight"}) {
    if (tensors.count(key)) return StateDictLayout::MultiheadAttention;
  }
  if (tensors.count("ln_1.weight") || tensors.count("attn.W_q.weight")) return StateDictLayout::TransformerBlock;
  return StateDictLayout::Documents;
}

// nn.MultiheadAttention's names onto SelfAttention's: in_proj_* is W_q, W_k, W_v stacked.
std::map<std::string, torch::Tensor> to_documents_layout(const std::map<std::string, torch::Tensor>& tensors,
                                                         const std::string& source) {
  if (detect_layout(tensors) != StateDictLayout::MultiheadAttention) return tensors;
  std::map<std::string, torch::Tensor> mapped;
  for (const auto& [key, tensor] : tensors) {
    if (key == "in_proj_weight" || key == "in_proj_bias") {
      TORCH_CHECK(tensor.dim() >= 1 && tensor.size(0) % 3 == 0, "load_state_dict: ", source, ": ", key, " has shape ",
                  tensor.sizes(), "; expected its first dimension to be 3 * d_model (W_q, W_k, W_v)");
      const auto parts = tensor.chunk(3, /*dim=*/0);
      const std::string suffix = key == "in_proj_weight" ? ".weight" : ".bias";
      mapped["W_q" + suffix] = parts[0];
      mapped["W_k" + suffix] = parts[1];
      mapped["W_v" + suffix] = parts[2];
    } else if (key == "q_proj_weight" || key == "k_proj_weight" || key == "v_proj_weight") {
      mapped[std::string("W_") + key[0] + ".weight"] = tensor;
    } else if (key.rfind("out_proj.", 0) == 0) {
      mapped["W_o." + key.substr(9)] = tensor;
    } else {
      mapped[key] =
          tensor;  // reported as unexpected by load_state_dict (bias_k / bias_v: add_bias_kv is not supported)
    }
  }
  return mapped;
}

namespace {

// Checks `tensors` against the module's parameters and copies them in only when everything fits.
void load_checked(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                  const std::string& source, StateDictLayout layout, const std::string& hint) {
  auto parameters = module.named_parameters();
  std::vector<std::string> missing, unexpected, mismatched, not_floating;
  for (const auto& item : parameters) {
    if (!tensors.count(item.key())) missing.push_back(item.key());
  }
  for (const auto& [key, tensor] : tensors) {
    const auto* parameter = parameters.find(key);
    if (!parameter) {
      unexpected.push_back(key);
    } else if (tensor.sizes() != parameter->sizes()) {
      mismatched.push_back(key + " is " + shape_text(tensor.sizes()) + ", the module's is " +
                           shape_text(parameter->sizes()));
    } else if (!tensor.is_floating_point()) {
      not_floating.push_back(key + " (" + std::string(c10::toString(tensor.scalar_type())) + ")");
    }
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty() || !not_floating.empty()) {
    std::ostringstream problem;
    problem << "load_state_dict: " << source << " (" << to_string(layout) << " layout) does not fit ";
    module.pretty_print(problem);
    problem << "; nothing was loaded.";
    if (!missing.empty()) problem << " Missing: " << join(missing) << ".";
    if (!unexpected.empty()) problem << " Unexpected: " << join(unexpected) << ".";
    if (!mismatched.empty()) problem << " Wrong shape: " << join(mismatched) << ".";
    if (!not_floating.empty()) problem << " Not floating-point: " << join(not_floating) << ".";
    if (!hint.empty() && missing.size() + unexpected.size() + mismatched.size() > 0) problem << " " << hint;
    TORCH_CHECK(false, problem.str());
  }
  torch::NoGradGuard no_grad;
  for (auto& item : parameters) {
    item.value().copy_(tensors.at(item.key()));  // copy_ converts dtype and device
  }
}

}  // namespace

void load_state_dict(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source) {
  load_checked(module, tensors, source, detect_layout(tensors), "");
}

void load_state_dict(SelfAttention& module, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source) {
  const auto layout = detect_layout(tensors);
  if (layout == StateDictLayout::MultiheadAttention) {
    std::string hint =
        "(nn.MultiheadAttention weights need SelfAttentionOptions(E).num_heads(H).out_proj(true), and bias, kdim "
        "and vdim as the Python module's.";
    // add_bias_kv=True appends learned rows to K and V, which qkv's module does not have.
    if (tensors.count("bias_k") || tensors.count("bias_v")) {
      hint += " bias_k and bias_v come from add_bias_kv=True, which qkv does not support.";
    }
    load_checked(*module, to_documents_layout(tensors, source), source, layout, hint + ")");
  } else {
    load_checked(*module, tensors, source, layout,
                 "(With grouped-query heads, W_k and W_v are (num_kv_heads * head width, kdim): set num_kv_heads to "
                 "the Python module's.)");
  }
}

void load_state_dict(TransformerBlock& block, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source) {
  load_checked(*block, tensors, source, detect_layout(tensors),
               "(A block's shapes follow d_model, num_kv_heads, mlp_ratio and bias: set them as the Python module's.)");
}

void load_state_dict(SelfAttention& module, const std::string& path) {
  load_state_dict(module, read_tensor_dict(path), path);
}

void load_state_dict(TransformerBlock& block, const std::string& path) {
  load_state_dict(block, read_tensor_dict(path), path);
}

void save_tensor_dict(const std::map<std::string, torch::Tensor>& tensors, const std::string& path) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, tensor] : tensors) dict.insert(name, tensor.detach().to(torch::kCPU).contiguous());
  const auto bytes = detail::torch_save_bytes(c10::IValue(dict));
  try {
    detail::write_file_atomically(path, bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "save_tensor_dict: ", e.what_without_backtrace());
  }
}

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& item : module.named_parameters()) tensors.emplace(item.key(), item.value());
  save_tensor_dict(tensors, path);
}

void save_state_dict(const SelfAttention& module, const std::string& path) { save_state_dict(*module, path); }

void save_state_dict(const TransformerBlock& block, const std::string& path) { save_state_dict(*block, path); }

}  // namespace qkv
