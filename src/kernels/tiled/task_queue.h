// Tasks handed out to LibTorch's threads as they become free, instead of at::parallel_for's fixed
// split (each of T threads takes 1/T of the range up front). Private to qkv.
//
// Why: with the fixed split a call lasts as long as its slowest thread. On the 2-vCPU VMs qkv is
// developed on, one vCPU often runs slower than the other (the host's other tenants); `perf record`
// of the bfloat16 core at B=8 H=8 N=512 D=32 (AMD EPYC Zen 5, 2026-12-02) showed the calling thread
// spinning in libgomp's barrier for about 20% of its samples while the other thread still had the
// same tasks to finish, every function 1.1-1.5× slower on it. Taken from a shared counter, the
// faster thread takes more tasks and both finish within one chunk of each other.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace qkv::kernels::tiled {

/// Tasks [0, tasks) in chunks of consecutive tasks (so that a thread keeps the locality of
/// neighbouring tasks: the row blocks of one head), each chunk taken by whichever thread asks first.
class TaskQueue {
 public:
  TaskQueue(int64_t tasks, int64_t chunk) : tasks_(tasks), chunk_(std::max<int64_t>(chunk, 1)) {}
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  /// The next chunk [begin, end); false once every task has been handed out.
  bool next_chunk(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= tasks_) return false;
    end = std::min(tasks_, begin + chunk_);
    return true;
  }

 private:
  const int64_t tasks_, chunk_;
  std::atomic<int64_t> next_{0};
};

/// One thread's tasks from a TaskQueue, one at a time: `for (int64_t task = 0; tasks.next(task);)`.
class ThreadTasks {
 public:
  explicit ThreadTasks(TaskQueue& queue) : queue_(queue) {}
  bool next(int64_t& task) {
    if (next_ == end_ && !queue_.next_chunk(next_, end_)) return false;
    task = next_++;
    return true;
  }

 private:
  TaskQueue& queue_;
  int64_t next_ = 0, end_ = 0;
};

/// Chunks per thread: enough that a thread running 1.5× slower than the other leaves it idle for at
/// most one chunk (about 1/16 of its share) at the end, few enough that the counter costs nothing.
constexpr int64_t kChunksPerThread = 16;

/// Runs body(tasks) once on each of up to at::get_num_threads() threads (once on the calling thread
/// when the tasks make a single chunk, or inside another parallel region), every thread taking
/// chunks of the same queue until it is empty: body makes its per-thread scratch, then loops
/// `for (int64_t task = 0; tasks.next(task);)`. `min_chunk`: the fewest tasks worth a handover
/// (tasks_per_chunk in kernel.h: decoding's tiny tasks stay on the calling thread). What a task
/// computes must not depend on the thread that runs it, so that results do not change from run to run.
template <typename Body>
void run_tasks(int64_t tasks, int64_t min_chunk, const Body& body) {
  if (tasks <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>({min_chunk, int64_t{1}, tasks / (threads * kChunksPerThread)});
  TaskQueue queue(tasks, chunk);
  const int64_t team = std::min(threads, (tasks + chunk - 1) / chunk);
  if (team <= 1) {
    ThreadTasks all(queue);
    body(all);
    return;
  }
  // One index per thread; were the body called for a range of them (a serial fallback), it would
  // still drain the queue.
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    ThreadTasks mine(queue);
    body(mine);
  });
}

}  // namespace qkv::kernels::tiled
