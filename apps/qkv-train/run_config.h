// What one qkv-train run is asked to do, as parsed from the command line.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace qkv_train {

struct RunConfig {
  std::string task = "seed";
  std::string device_name = "auto";  // auto | cpu | cuda
  int64_t d_model = 8;
  int64_t seq_len = 4;
  int64_t steps = 1;
  double lr = 0.01;
  uint64_t seed = 42;
  int threads = 0;  // 0: LibTorch's default
  bool json = false;
};

/// The device `name` asks for; throws std::runtime_error when CUDA is asked for but absent.
torch::Device resolve_device(const std::string& name);

}  // namespace qkv_train
