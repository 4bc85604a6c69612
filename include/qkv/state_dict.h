// Weights to and from PyTorch: files written by Python's torch.save, read into qkv::SelfAttention,
// and qkv's weights written so that Python's torch.load reads them.
#pragma once

#include <qkv/self_attention.h>

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
};

/// Reads a dict of tensors written by Python's `torch.save(dict, path)` (or by save_state_dict).
/// Throws c10::Error naming the file and the problem. LibTorch 1.13 cannot read the OrderedDict
/// that `model.state_dict()` returns; the error then says how to save the file instead.
std::map<std::string, torch::Tensor> read_tensor_dict(const std::string& path);
/// The same for a file's bytes; `name` is the file's name in messages.
std::map<std::string, torch::Tensor> read_tensor_dict(const std::vector<char>& bytes, const std::string& name);

/// Checks that an archive written by torch.save / torch::save (a zip file) is whole: its
/// directory is readable and every entry matches its recorded CRC-32 (LibTorch 1.13 does not
/// check these itself). Throws c10::Error naming `path` and the problem.
void verify_torch_archive(const char* data, size_t size, const std::string& path);

/// Recognises the layout of `tensors` from its key names.
StateDictLayout detect_layout(const std::map<std::string, torch::Tensor>& tensors);

/// Loads `tensors` (either layout) into `module`, converting dtype and device to the module's.
/// Missing, unexpected or wrongly shaped keys are refused with a message listing them all, and
/// then nothing is loaded. `source` names the tensors' origin in messages.
void load_state_dict(SelfAttention& module, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source = "state dict");

/// read_tensor_dict + load_state_dict.
void load_state_dict(SelfAttention& module, const std::string& path);

/// Writes `tensors` as a dict {name: tensor} (moved to the CPU) in the format of Python's
/// torch.save, so that `torch.load(path)` reads it; the counterpart of read_tensor_dict. Written
/// to a temporary name, then renamed: a failure never leaves a half-written file at `path`.
void save_tensor_dict(const std::map<std::string, torch::Tensor>& tensors, const std::string& path);

/// Writes the module's parameters as a dict {name: tensor} (CPU, same dtype) in the format of
/// Python's torch.save, with the documents' key names: `SelfAttention(d).load_state_dict(
/// torch.load(path))` works in Python. Written to a temporary name, then renamed.
void save_state_dict(const SelfAttention& module, const std::string& path);

}  // namespace qkv
