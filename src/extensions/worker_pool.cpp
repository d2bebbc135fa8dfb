// The persistent worker pool behind parallel_for (see worker_pool.h).
#include "worker_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "profile.h"

namespace tiny_llm {

namespace {

std::atomic<int> g_num_threads{0};

// ANCHOR: cpu_threads
// A job's threads find it without a system call when they are quick: a worker that has
// just finished spins for kSpin before it sleeps, and so does the caller waiting for the
// helpers' last items. A decode step runs a few hundred small kernels (the linear layers,
// attention) a few microseconds apart, and waking a sleeping thread can take longer than
// most of those kernels do. The spin is short: longer ones slow the MLX ops that run
// between the kernels (a tuned length). Nothing ever
// waits for a spinning thread: items go one at a time to whichever thread asks, so a
// thread that a busy neighbour keeps off its core only takes fewer of them.
constexpr auto kSpin = std::chrono::microseconds(50);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");  // a hint to the core, not a system call
#else
  std::this_thread::yield();
#endif
}

// Spins until done() or kSpin has passed; returns done().
template <typename Done>
bool spin_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    for (int i = 0; i < 64; ++i) cpu_relax();
  }
  return true;
}

class WorkerPool {
 public:
  static WorkerPool& instance() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: workers may be waiting
    return *pool;
  }

  // Runs fn(0..n-1) on `threads` threads, the calling one included.
  void run(int n, int threads, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> one_job(job_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(workers_.size()) < threads - 1) {
        const int id = static_cast<int>(workers_.size());
        workers_.emplace_back([this, id] { serve(id); });
      }
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      pending_.store(threads - 1);
      // One word holds the job's number and its helper count, so a worker reads both at once.
      job_.store(((job_.load() >> 8) + 1) << 8 | static_cast<uint64_t>(threads - 1));
    }
    wake_.notify_all();
    drain();
    {
      ProfileScope waiting(Phase::kThreadWait);
      if (!spin_until([&] { return pending_.load() == 0; })) {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return pending_.load() == 0; });
      }
    }
    // Every thread is done with fn before an error leaves this frame (fn lives in it).
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void drain() {
    for (int i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_);  // hand out no more items
      }
    }
  }

  void serve(int id) {
    profile_mark_helper();
    uint64_t seen = 0;
    for (;;) {
      if (!spin_until([&] { return job_.load() != seen; })) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return job_.load() != seen; });
      }
      seen = job_.load();
      // A helper of this job: the job cannot end (nor a newer one start) before it is done.
      if (id >= static_cast<int>(seen & 0xff)) continue;
      drain();
      if (pending_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
      }
    }
  }

  std::mutex job_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<int> next_{0}, pending_{0};
  std::atomic<uint64_t> job_{0};  // job number << 8 | helpers
  int n_ = 0;
  std::exception_ptr error_;
};

}  // namespace

int pool_threads() {
  // Asked once: glibc answers hardware_concurrency() by reading a file in /sys, a few
  // microseconds of system calls that a decode step's ~170 kernels each paid.
  static const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int configured = g_num_threads.load();
  return configured > 0 ? configured : hardware;
}

void parallel_for(int n, double flops_per_item, const std::function<void(int)>& fn) {
  const double total = n * flops_per_item;
  const int threads =
      std::min({pool_threads(), n, 256, std::max(1, static_cast<int>(total / 2e5))});
  profile_count_job(threads > 1);
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  WorkerPool::instance().run(n, threads, fn);
}
// ANCHOR_END: cpu_threads

void set_num_threads(int n) { g_num_threads.store(n); }

}  // namespace tiny_llm
