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

// SIGINT and SIGTERM, less those this process was started with ignored: a background job of a
// script (its shell ignores SIGINT for it, so that a Ctrl-C meant for the script leaves the job
// running), nohup, a parent's choice. Those stay ignored, as they did before qkv-train took
// signals on a thread of its own (a blocked signal is not discarded even when ignored, so taking
// it with sigwait would undo the parent's choice). Read once, by take_stop_signals_on_own_thread.
sigset_t taken_signals;

sigset_t stop_signals_not_ignored() {
  sigset_t set;
  sigemptyset(&set);
  for (const int signal : {SIGINT, SIGTERM}) {
    struct sigaction current {};
    if (sigaction(signal, nullptr, &current) == 0 && current.sa_handler != SIG_IGN) sigaddset(&set, signal);
  }
  return set;
}

bool takes(int signal) { return sigismember(&taken_signals, signal) == 1; }

void record_signal(int signal) { received.store(signal); }

// The signal thread: records each signal while training catches them; before that, gives the
// signal its default action (the process ends with it, as a shell expects of Ctrl-C).
[[noreturn]] void take_signals() {
  for (;;) {
    int signal = 0;
    if (sigwait(&taken_signals, &signal) != 0) continue;
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
  taken_signals = stop_signals_not_ignored();
  if (!takes(SIGINT) && !takes(SIGTERM)) return;  // both ignored: nothing to take
  if (const int error = pthread_sigmask(SIG_BLOCK, &taken_signals, nullptr); error != 0) {
    throw std::system_error(error, std::generic_category(), "cannot block SIGINT and SIGTERM");
  }
  std::thread(take_signals).detach();
}

void catch_stop_signals() {
  catching.store(true);
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  for (const int signal : {SIGINT, SIGTERM}) {
    if (takes(signal)) sigaction(signal, &action, nullptr);
  }
}

int stop_signal_received() { return received.load(); }

void start_children_with_default_signals(posix_spawnattr_t& attributes) {
  sigset_t none;
  sigemptyset(&none);
  int error = posix_spawnattr_setsigmask(&attributes, &none);
  if (error == 0) error = posix_spawnattr_setsigdefault(&attributes, &taken_signals);
  if (error == 0) error = posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  if (error != 0) throw std::runtime_error(std::string("cannot set a child's signals: ") + std::strerror(error));
}

}  // namespace qkv_train
