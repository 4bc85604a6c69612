// What a run took of the machine, for summary.json and --generate's report.
#pragma once

#include <sys/resource.h>

namespace qkv_train {

/// The process's peak resident set so far (getrusage: kilobytes on Linux), in MiB: what a run
/// needed of the machine's memory, e.g. with and without --checkpoint-activations.
inline double peak_resident_megabytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

}  // namespace qkv_train
