// The persistent worker pool behind parallel_for (see worker_pool.h).
#include "worker_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace tiny_llm {

namespace {

std::atomic<int> g_num_threads{0};

// ANCHOR: cpu_threads
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
      helpers_ = pending_ = threads - 1;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    // Every thread is done with fn before an error leaves this frame (fn lives in it).
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
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (id >= helpers_) continue;
      lock.unlock();
      drain();
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex job_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<int> next_{0};
  int n_ = 0, helpers_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
};

}  // namespace

void parallel_for(int n, double flops_per_item, const std::function<void(int)>& fn) {
  int hw = g_num_threads.load();
  if (hw <= 0) hw = std::max(1u, std::thread::hardware_concurrency());
  const double total = n * flops_per_item;
  const int threads = std::min({hw, n, std::max(1, static_cast<int>(total / 2e5))});
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  WorkerPool::instance().run(n, threads, fn);
}
// ANCHOR_END: cpu_threads

void set_num_threads(int n) { g_num_threads.store(n); }

}  // namespace tiny_llm
