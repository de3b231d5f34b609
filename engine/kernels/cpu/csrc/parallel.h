// How the kernels share their work between threads: tasks handed out in chunks to whichever
// thread asks next, not split evenly up front.
//
// The server's other processes (tokenizer, detokenizer, HTTP clients) run on the same cores
// as the forward. at::parallel_for gives each thread an equal share, so when the OS preempts
// one thread the op waits for that thread's whole share; with claimed chunks the others take
// the rest of the work, and the op waits only for the chunk the preempted thread holds.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace radixserve {

// Tasks [0, tasks) in chunks of `chunk`, each claimed once.
class TaskQueue {
 public:
  TaskQueue(int64_t tasks, int64_t chunk) : tasks_(tasks), chunk_(std::max<int64_t>(chunk, 1)) {}

  // The next unclaimed chunk [begin, end); false once every task is claimed.
  bool claim(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    end = std::min(tasks_, begin + chunk_);
    return begin < tasks_;
  }

  int64_t chunks() const { return (tasks_ + chunk_ - 1) / chunk_; }

 private:
  const int64_t tasks_, chunk_;
  std::atomic<int64_t> next_{0};
};

// Runs `worker(queue)` once on each of at::parallel_for's threads (no more threads than
// chunks); a worker claims chunks from `queue` until none are left, with any per-thread
// setup around its loop.
template <typename Worker>
void parallel_claim(int64_t tasks, int64_t chunk, const Worker& worker) {
  TaskQueue queue(tasks, chunk);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), queue.chunks());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(queue); });
}

// A chunk that leaves about `per_thread` chunks to each thread: small enough that a
// preempted thread holds back little, large enough that claiming costs nothing.
inline int64_t chunk_for(int64_t tasks, int64_t per_thread = 8) {
  return std::max<int64_t>(1, tasks / (per_thread * at::get_num_threads()));
}

// A matmul's weight rows [0, n_size) in groups of `group` that the threads claim; each group
// stays in L1 while every row of x passes over it, `tile` rows at a time:
// `fn(m, rows, n, claimed_end)` for each tile of x (its first row and row count) and each
// weight row n of the group (`claimed_end`: the end of the chunk n was claimed in).
template <typename Fn>
void for_each_weight_row_tile(int64_t m_size, int64_t n_size, int64_t group, int64_t tile,
                              const Fn& fn) {
  const int64_t tasks = (n_size + group - 1) / group;
  parallel_claim(tasks, chunk_for(tasks), [&](auto& queue) {
    for (int64_t begin, end; queue.claim(begin, end);) {
      const int64_t n_begin = begin * group, n_end = std::min(n_size, end * group);
      for (int64_t m = 0; m < m_size; m += tile) {
        const int64_t rows = std::min(tile, m_size - m);
        for (int64_t n = n_begin; n < n_end; ++n) fn(m, rows, n, n_end);
      }
    }
  });
}

}  // namespace radixserve
