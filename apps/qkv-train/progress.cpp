#include "progress.h"

#include <spdlog/spdlog.h>

namespace qkv_train {

Progress::Progress(Mode mode, int64_t first_step, int64_t last_step, int64_t tokens_per_step, int64_t log_every,
                   std::FILE* terminal)
    : mode_(mode), first_step_(first_step), last_step_(last_step), tokens_per_step_(tokens_per_step),
      log_every_(log_every), step_(first_step), terminal_(terminal), start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

double Progress::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

double Progress::steps_per_second() const {
  const double elapsed = elapsed_seconds() - excluded_seconds_;
  return elapsed > 0 ? static_cast<double>(step_ - first_step_) / elapsed : 0.0;
}

void Progress::update(int64_t step, double loss) {
  step_ = step;
  const double rate = steps_per_second();
  const double eta = rate > 0 ? static_cast<double>(last_step_ - step) / rate : 0.0;
  if (mode_ == Mode::Terminal) {
    const auto now = std::chrono::steady_clock::now();
    if (step != last_step_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    std::fprintf(terminal_, "\r\033[Kstep %lld/%lld | loss %.5f | %.1f steps/s | %.0f tokens/s | ETA %.0f s",
                 static_cast<long long>(step), static_cast<long long>(last_step_), loss, rate, tokens_per_second(),
                 eta);
    std::fflush(terminal_);
  } else if (mode_ == Mode::LogLines && (step % log_every_ == 0 || step == last_step_)) {
    spdlog::info("step {}/{} loss {:.5f} {:.1f} steps/s {:.0f} tokens/s ETA {:.0f} s", step, last_step_, loss, rate,
                 tokens_per_second(), eta);
  }
}

void Progress::finish() {
  if (mode_ == Mode::Terminal) {
    std::fputc('\n', terminal_);
    std::fflush(terminal_);
  }
}

}  // namespace qkv_train
