// Runs the fuzz targets' inputs without libFuzzer: the seeds and regression inputs, and a fixed set
// of mutants of each, through the same LLVMFuzzerTestOneInput the fuzzers call.
//
// libFuzzer needs clang, so the targets were built only by scripts/fuzz.sh, and a change to an API
// they call went unseen by the three suites and the sanitizer build (fuzz_checkpoint_loader once
// called a function removed the same day). Built with the suites (fuzz/CMakeLists.txt), the
// targets compile on every LibTorch the suites cover, with GCC, and their inputs run under the
// sanitizers there too.
//
//   qkv_fuzz_replay TARGET [--mutants N] PATH...
//
// TARGET: weights_loader, checkpoint_loader, train_options or backends. PATH: an input file or a
// folder of them. Each input runs as it is, then N mutants of it, each made from the input by one to
// three mutations: the target's own LLVMFuzzerCustomMutator where it has one (the archive rewrite
// of fuzz/archive_mutator.h), else the byte edits below. The mutants depend only on the input and
// their number, so a failure repeats. A target reports a finding by crashing, as under libFuzzer;
// the input it crashed on is then in ./replay-last-input.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

// The targets' entry points, renamed by the wrappers fuzz/CMakeLists.txt generates: each target
// source defines LLVMFuzzerTestOneInput (and maybe LLVMFuzzerCustomMutator), and one program holds
// them all.
extern "C" {
int qkv_fuzz_weights_loader(const uint8_t* data, size_t size);
size_t qkv_fuzz_weights_loader_mutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed);
int qkv_fuzz_checkpoint_loader(const uint8_t* data, size_t size);
size_t qkv_fuzz_checkpoint_loader_mutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed);
int qkv_fuzz_train_options(const uint8_t* data, size_t size);
int qkv_fuzz_backends(const uint8_t* data, size_t size);
}

namespace {

std::minstd_rand byte_edits_random;

}  // namespace

// libFuzzer's byte mutation, which fuzz/archive_mutator.cpp calls; here a few of its simplest
// edits: flip a bit, write a boundary value, insert a byte, erase one.
extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size) {
  static const uint8_t boundary_values[] = {0x00, 0x01, 0x7f, 0x80, 0xff, '\n', '-', '0', '9'};
  const int edits = 1 + static_cast<int>(byte_edits_random() % 4);
  for (int edit = 0; edit < edits; ++edit) {
    const auto r = byte_edits_random();
    switch (r % 4) {
      case 0:
        if (size > 0) data[(r >> 3) % size] ^= static_cast<uint8_t>(1u << ((r >> 2) % 8));
        break;
      case 1:
        if (size > 0) data[(r >> 3) % size] = boundary_values[(r >> 2) % sizeof(boundary_values)];
        break;
      case 2:
        if (size < max_size) {
          const size_t at = (r >> 3) % (size + 1);
          std::memmove(data + at + 1, data + at, size - at);
          data[at] = static_cast<uint8_t>(r >> 11);
          ++size;
        }
        break;
      default:
        if (size > 0) {
          const size_t at = (r >> 3) % size;
          std::memmove(data + at, data + at + 1, size - at - 1);
          --size;
        }
        break;
    }
  }
  return size;
}

namespace {

namespace fs = std::filesystem;

using TestOneInput = int (*)(const uint8_t*, size_t);
using CustomMutator = size_t (*)(uint8_t*, size_t, size_t, unsigned int);

struct Target {
  TestOneInput run;
  CustomMutator mutate;  // null: the byte edits
};

const std::map<std::string, Target>& targets() {
  static const std::map<std::string, Target> known{
      {"weights_loader", {qkv_fuzz_weights_loader, qkv_fuzz_weights_loader_mutator}},
      {"checkpoint_loader", {qkv_fuzz_checkpoint_loader, qkv_fuzz_checkpoint_loader_mutator}},
      {"train_options", {qkv_fuzz_train_options, nullptr}},
      {"backends", {qkv_fuzz_backends, nullptr}},
  };
  return known;
}

std::string known_targets() {
  std::string names;
  for (const auto& [name, target] : targets()) names += (names.empty() ? "" : ", ") + name;
  return names;
}

int usage_error(const std::string& message) {
  std::cerr << "qkv_fuzz_replay: " << message << "\n"
            << "usage: qkv_fuzz_replay TARGET [--mutants N] PATH...  (TARGET: " << known_targets() << ")\n";
  return 2;
}

std::vector<uint8_t> read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// Where the input about to run is kept, so that a crash leaves it behind.
void keep_as_last_input(const std::vector<uint8_t>& bytes) {
  std::ofstream file("replay-last-input", std::ios::binary | std::ios::trunc);
  file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage_error("expected a target and inputs, got nothing");
  const std::string name = argv[1];
  const auto found = targets().find(name);
  if (found == targets().end()) return usage_error("expected a target among " + known_targets() + ", got '" + name + "'");
  const Target target = found->second;

  long mutants = 0;
  std::vector<fs::path> inputs;
  for (int i = 2; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--mutants") {
      char* end = nullptr;
      mutants = i + 1 < argc ? std::strtol(argv[i + 1], &end, 10) : -1;
      if (i + 1 >= argc || end == argv[i + 1] || *end != '\0' || mutants < 0 || mutants > 100000) {
        return usage_error("--mutants: expected a whole number from 0 to 100000, got '" +
                           std::string(i + 1 < argc ? argv[i + 1] : "") + "'");
      }
      ++i;
      continue;
    }
    std::error_code error;
    if (fs::is_directory(argument, error)) {
      std::vector<fs::path> files;
      for (const auto& entry : fs::directory_iterator(argument)) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
      std::sort(files.begin(), files.end());  // a fixed order, so the mutants repeat
      inputs.insert(inputs.end(), files.begin(), files.end());
    } else if (fs::is_regular_file(argument, error)) {
      inputs.emplace_back(argument);
    } else {
      return usage_error("expected an input file or a folder of them, got '" + argument + "' (no such file or folder)");
    }
  }
  if (inputs.empty()) return usage_error("expected at least one input, got none (the folders named are empty)");

  const auto start = std::chrono::steady_clock::now();
  std::cout << name << ": replaying " << inputs.size() << " inputs and " << mutants
            << " mutants of each; a crash leaves its input in " << (fs::current_path() / "replay-last-input").string()
            << std::endl;
  for (size_t index = 0; index < inputs.size(); ++index) {
    const auto original = read_file(inputs[index]);
    keep_as_last_input(original);
    target.run(original.data(), original.size());
    for (long mutant = 1; mutant <= mutants; ++mutant) {
      const unsigned int seed = static_cast<unsigned int>(index * 100003 + static_cast<size_t>(mutant));
      byte_edits_random.seed(seed);
      std::minstd_rand rounds(seed);
      const size_t max_size = std::max<size_t>(2 * original.size(), original.size() + 4096);
      std::vector<uint8_t> bytes(original);
      bytes.resize(max_size);
      size_t size = original.size();
      for (unsigned int round = 0, count = 1 + rounds() % 3; round < count; ++round) {
        size = target.mutate ? target.mutate(bytes.data(), size, max_size, seed + round)
                             : LLVMFuzzerMutate(bytes.data(), size, max_size);
      }
      bytes.resize(size);
      keep_as_last_input(bytes);
      target.run(bytes.data(), bytes.size());
    }
  }
  std::error_code ignored;
  fs::remove("replay-last-input", ignored);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: %zu inputs and %zu mutants ran in %.1f s, no crash\n", name.c_str(), inputs.size(),
              inputs.size() * static_cast<size_t>(mutants), seconds);
  return 0;
}
