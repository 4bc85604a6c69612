// Training progress: a line redrawn in place on a terminal, plain log lines elsewhere.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace qkv_train {

class Progress {
 public:
  enum class Mode { Terminal, LogLines, Quiet };

  /// `tokens_per_step`: B * N, for tokens/s. `terminal` is where a Terminal line is drawn.
  Progress(Mode mode, int64_t first_step, int64_t last_step, int64_t tokens_per_step, int64_t log_every,
           std::FILE* terminal);

  void update(int64_t step, double loss);
  void finish();

  /// Steps (and tokens) per second of training: evaluation time excluded (see exclude).
  double steps_per_second() const;
  double tokens_per_second() const { return steps_per_second() * static_cast<double>(tokens_per_step_); }
  /// Seconds since the start, everything included.
  double elapsed_seconds() const;
  /// Seconds spent on other work than training (evaluations), left out of the rates.
  void exclude(double seconds) { excluded_seconds_ += seconds; }

 private:
  Mode mode_;
  int64_t first_step_, last_step_, tokens_per_step_, log_every_;
  int64_t step_ = 0;
  std::FILE* terminal_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  double excluded_seconds_ = 0.0;
};

}  // namespace qkv_train
