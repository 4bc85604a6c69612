#include "stop_signals.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

namespace qkv_train {

namespace {

std::atomic<bool> catching{false};
std::atomic<int> received{0};

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

void record_signal(int signal) { received.store(signal); }

// The signal thread: records each signal while training catches them; before that, gives the
// signal its default action (the process ends with it, as a shell expects of Ctrl-C).
[[noreturn]] void take_signals() {
  const sigset_t set = stop_signals();
  for (;;) {
    int signal = 0;
    if (sigwait(&set, &signal) != 0) continue;
    if (catching.load()) {
      received.store(signal);
      continue;
    }
    struct sigaction action {};
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    sigaction(signal, &action, nullptr);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, signal);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    raise(signal);  // to this thread, where it is now unblocked: the process ends
  }
}

}  // namespace

void take_stop_signals_on_own_thread() {
  const sigset_t set = stop_signals();
  if (const int error = pthread_sigmask(SIG_BLOCK, &set, nullptr); error != 0) {
    throw std::system_error(error, std::generic_category(), "cannot block SIGINT and SIGTERM");
  }
  std::thread(take_signals).detach();
}

void catch_stop_signals() {
  catching.store(true);
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int stop_signal_received() { return received.load(); }

void start_children_with_default_signals(posix_spawnattr_t& attributes) {
  sigset_t none;
  sigemptyset(&none);
  const sigset_t defaults = stop_signals();
  int error = posix_spawnattr_setsigmask(&attributes, &none);
  if (error == 0) error = posix_spawnattr_setsigdefault(&attributes, &defaults);
  if (error == 0) error = posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  if (error != 0) throw std::runtime_error(std::string("cannot set a child's signals: ") + std::strerror(error));
}

}  // namespace qkv_train
