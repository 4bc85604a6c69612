// What qkv's command-line programs share: CLI11 error handling (one line, exit status 2) and the
// names of dtypes.
#pragma once

#include <torch/types.h>
#include <CLI/CLI.hpp>

#include <optional>
#include <string>
#include <vector>

namespace qkv_cli {

/// Parses `argv` with `app`. Returns nullopt when the program should go on, else the exit status:
/// 0 after --help, 2 after a bad command line, reported as one line "<program>: error: ... (see --help)".
std::optional<int> parse(CLI::App& app, int argc, const char* const* argv);

/// The check of a real-valued option: a finite number from `lower` (excluded where `lower_open`) to
/// `upper`. CLI11's Range and PositiveNumber let nan through (every comparison with it is false),
/// and print their bounds with all their digits ("0.000000 to 1797693134862315708...").
/// The error names the option and says what it expected and what came: "--lr: expected a finite
/// number > 0 and <= 1e+38, got nan".
CLI::Validator real_in(double lower, double upper, bool lower_open = false);

/// Prints "<program>: error: <message> (see --help)" as one line on stderr and returns 2.
int usage_error(const std::string& program, const std::string& message);

/// "" where qkv takes the environment's route settings (QKV_TILED_ISA, QKV_LINEAR_GEMM), else its
/// one-line reason for refusing one (the variable, its value and the values it takes): the programs
/// check it before they run anything, as a usage error (exit status 2), not at the first layer.
std::string route_setting_problem();

/// The dtype names the programs accept, and the dtype each stands for.
const std::vector<std::string>& dtype_names();               // float32, float64, bfloat16, float16
torch::ScalarType dtype_from_name(const std::string& name);  // throws std::invalid_argument for others

/// glibc's malloc serves every block above its mmap threshold (128 KiB at first, rising to at most
/// 32 MiB as such blocks are freed) with a fresh mapping and gives it back when freed, so a training
/// step's large tensors fault their pages in anew on every step: on the 2-core VM this was measured
/// on (AMD EPYC, Zen 5), page faults took a fifth of the language model's float32 step. This sets
/// a threshold of 32 MiB and a trim threshold of 256 MiB, as GLIBC_TUNABLES
/// `glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456` would: freed blocks
/// stay in the heap for the next step (memory is kept at the peak, as PyTorch's CUDA caching
/// allocator keeps it). Leaves malloc as it is where the environment sets either threshold
/// (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, glibc.malloc.mmap_threshold or
/// glibc.malloc.trim_threshold; another malloc tunable beside them, such as glibc.malloc.hugetlb=1,
/// does not count) and where the C library is not glibc. Blocks above 32 MiB are still mapped
/// afresh, which no mallopt setting changes; README.md ("The allocator") says what helps them.
/// Returns whether it changed anything. For programs, not for the library (qkv never changes
/// its host's allocator).
bool keep_freed_memory_for_reuse();

}  // namespace qkv_cli
