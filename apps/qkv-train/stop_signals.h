// SIGINT and SIGTERM for qkv-train, taken on a thread of their own.
//
// A signal handler runs on whichever thread the kernel picks, in the middle of whatever that
// thread runs. JIT-compiled code does not always leave room for it: oneDNN's float32 GEMM before
// 3.11.2 points the stack pointer into a heap workspace while it multiplies (oneDNN issue #4845),
// and a Ctrl-C handled there corrupted qkv-train's heap. qkv's linear layers no longer take that
// GEMM, but other code in the process (LibTorch's, oneDNN's, OpenBLAS's) could do the same. So
// both signals are blocked from the first line of main, which every thread started later
// inherits, and one thread takes them with sigwait: no handler frame ever lands on a thread that
// computes.
#pragma once

#include <spawn.h>

namespace qkv_train {

/// Blocks SIGINT and SIGTERM in the calling thread and starts the thread that takes them.
/// Call it first in main, before anything starts a thread: threads inherit the mask at creation.
/// Until catch_stop_signals(), a signal still ends the process at once, as by default. A signal
/// the process was started with ignored (a background job of a script ignores SIGINT; nohup)
/// is left alone and stays ignored throughout.
void take_stop_signals_on_own_thread();

/// From now on SIGINT and SIGTERM are recorded (stop_signal_received()) instead of ending the
/// process: the training loop finishes its step, saves a checkpoint and exits with 128 + signal.
/// Threads that were running before take_stop_signals_on_own_thread() (a library's, started while
/// it loaded) still see the signals: a handler that only records them covers those.
void catch_stop_signals();

/// The last SIGINT or SIGTERM recorded since catch_stop_signals(), or 0.
int stop_signal_received();

/// Sets posix_spawn's attributes so that the child starts with no signal blocked and the signals
/// this process takes at their default actions (a blocked mask survives exec); one this process
/// ignores stays ignored in the child, as inherited. Throws std::runtime_error if the C library
/// refuses the attributes.
void start_children_with_default_signals(posix_spawnattr_t& attributes);

}  // namespace qkv_train
