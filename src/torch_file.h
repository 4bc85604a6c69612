// The file format of Python's torch.save (a zip archive holding a pickle and the tensors' bytes):
// reading it checked, and writing it as Python's weights_only loader accepts. Private to qkv's
// build; the public face is read_tensor_dict / save_tensor_dict (state_dict.h).
#pragma once

#include "pickle_reader.h"

#include <ATen/core/ivalue.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <functional>
#include <string>
#include <vector>

namespace qkv::detail {

/// The bytes of the file at `path`; throws c10::Error "<caller>: cannot read <path>: <reason>".
std::vector<char> read_file_bytes(const std::string& path, const char* caller);

/// The object a torch.save file holds: the archive checked (verify_torch_archive) and its
/// pickle read by qkv itself (read_weights_pickle), not by LibTorch's unpickler, which trusts
/// its input. Plain data and CPU tensors; an OrderedDict (Python's state_dict()) reads as a dict.
/// A damaged or crafted file is refused with a c10::Error "<caller>: <name>: ...".
c10::IValue read_torch_file(const std::vector<char>& bytes, const std::string& name, const char* caller);

/// The file torch::serialize::OutputArchive::save_to writes, in memory.
std::vector<char> archive_bytes(torch::serialize::OutputArchive& archive);

/// The torch::serialize::OutputArchive in `bytes` (qkv-train's checkpoints), open for reading,
/// without LibTorch's importer ever compiling the file's own code: the archive checked
/// (verify_torch_archive), its objects read by qkv (read_archive_pickle), then written again by
/// LibTorch's OutputArchive, whose class definitions the importer compiles instead. `adjust`, when
/// given, may change the objects before that (qkv-train: its optimizer's state keys). Its tensors
/// are on `device` (LibTorch's map_location; the CPU when not given). A damaged or crafted file is
/// refused with a c10::Error naming `path`.
torch::serialize::InputArchive read_serialize_archive(const std::vector<char>& bytes, const std::string& path,
                                                      const std::function<void(ArchiveObject& root)>& adjust = {},
                                                      const c10::optional<torch::Device>& device = c10::nullopt);

/// `value` (dicts, lists, tensors, numbers, strings) in torch.save's format. Unlike
/// torch::pickle_save, containers carry no TorchScript type tags
/// (torch.jit._pickle.restore_type_tag), which Python's default torch.load (weights_only, since
/// PyTorch 2.6) refuses; the files load in PyTorch 1.13 and 2.x alike.
std::vector<char> torch_save_bytes(const c10::IValue& value);

}  // namespace qkv::detail
