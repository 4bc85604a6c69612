// Weights to and from PyTorch: files written by Python's torch.save, read into qkv's modules, and
// qkv's weights written so that Python's torch.load (weights_only, the default since 2.6) reads them.
#pragma once

#include <qkv/self_attention.h>
#include <qkv/transformer_block.h>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <map>
#include <string>
#include <vector>

namespace qkv {

/// The layouts load_state_dict recognises by their key names.
enum class StateDictLayout {
  /// The documents' Python module: W_q.weight, W_q.bias, W_k.*, W_v.* (and qkv's W_o.*).
  Documents,
  /// torch.nn.MultiheadAttention: in_proj_weight (3E, E) and in_proj_bias, or q/k/v_proj_weight
  /// when kdim/vdim differ from E; out_proj.weight, out_proj.bias.
  MultiheadAttention,
  /// qkv::TransformerBlock and its Python reference: ln_1.*, attn.W_q.*, ..., mlp_fc.*, mlp_proj.*.
  TransformerBlock,
};

const char* to_string(StateDictLayout layout);

/// Reads a dict of tensors written by Python's `torch.save(model.state_dict(), path)` (an
/// OrderedDict; a plain dict, or save_tensor_dict's file, alike). qkv reads the file's pickle
/// itself, accepting only plain data and tensors, each checked to lie inside the file, rather than
/// with LibTorch's unpickler, which trusts its input. Tensors saved from a GPU load on the CPU.
/// Throws c10::Error naming the file and the problem.
std::map<std::string, torch::Tensor> read_tensor_dict(const std::string& path);
/// The same for a file's bytes; `name` is the file's name in messages.
std::map<std::string, torch::Tensor> read_tensor_dict(const std::vector<char>& bytes, const std::string& name);

/// Recognises the layout of `tensors` from its key names.
StateDictLayout detect_layout(const std::map<std::string, torch::Tensor>& tensors);

/// `tensors` under the documents' key names: nn.MultiheadAttention's in_proj_weight / in_proj_bias
/// split into W_q, W_k, W_v, q/k/v_proj_weight renamed, out_proj.* as W_o.*; other layouts and
/// keys unchanged. Throws c10::Error naming `source` when in_proj_* cannot be split in three.
std::map<std::string, torch::Tensor> to_documents_layout(const std::map<std::string, torch::Tensor>& tensors,
                                                         const std::string& source = "state dict");

/// Loads `tensors` into `module` by parameter name, converting dtype and device to the module's.
/// Missing, unexpected, wrongly shaped or non-floating tensors are refused with a message listing
/// them all, and then nothing is loaded. `source` names the tensors' origin in messages.
void load_state_dict(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source = "state dict");
/// For SelfAttention, also nn.MultiheadAttention's layout (mapped onto W_q, W_k, W_v, W_o).
void load_state_dict(SelfAttention& module, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source = "state dict");
void load_state_dict(TransformerBlock& block, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source = "state dict");

/// read_tensor_dict + load_state_dict.
void load_state_dict(SelfAttention& module, const std::string& path);
void load_state_dict(TransformerBlock& block, const std::string& path);

/// Writes `tensors` as a plain dict {name: tensor} (moved to the CPU) in the format of Python's
/// torch.save, so that `torch.load(path)` reads it (with weights_only too); the counterpart of
/// read_tensor_dict. The write is atomic and durable: a temporary file is written and flushed to
/// disk, then renamed over `path`; a failure or a crash never leaves a partial file at `path`.
void save_tensor_dict(const std::map<std::string, torch::Tensor>& tensors, const std::string& path);

/// Writes a module's parameters as a dict {name: tensor} (CPU, same dtype) with save_tensor_dict:
/// `SelfAttention(d).load_state_dict(torch.load(path))` works in Python for the documents' module,
/// and the reference TransformerBlock's likewise.
void save_state_dict(const torch::nn::Module& module, const std::string& path);
void save_state_dict(const SelfAttention& module, const std::string& path);
void save_state_dict(const TransformerBlock& block, const std::string& path);

}  // namespace qkv
