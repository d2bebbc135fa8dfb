// Where the CPU kernels' time goes: a clock per kind of work, off unless asked for
// (benches/bench_roofline.py turns it on to account for a step).
//
// A ProfileScope at the entry of a kernel function adds the wall time between its start
// and its end to its phase, on the thread that called the kernel (MLX's stream thread):
// the pool's helper threads never count, so the phases add up to wall time, not to the
// cores' time. Scopes nest exclusively: an inner scope's time is its own phase's and not
// the outer one's (the fused decoder's projections are projections, not "decoder"), and
// the time the calling thread spends waiting at the end of a pool job for the helpers
// still working (kThreadWait) is taken out of the phase it happened in. Off, a scope is
// one relaxed atomic load.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>

namespace tiny_llm {

enum class Phase : int {
  kProjections,  // the linear layers: decode-row kernels, OpenBLAS's blocks, int8 rows
  kAttention,    // paged attention over the pages
  kKvWrite,      // the step's K/V rows copied into their pages
  kVectorOps,    // norms, RoPE, SwiGLU and the residual additions
  kThreadWait,   // the caller waiting for the pool's other threads at the end of a job
  kCount
};

constexpr std::array<const char*, static_cast<int>(Phase::kCount)> kPhaseNames = {
    "projections", "attention", "kv_write", "vector_ops", "thread_wait"};

struct ProfileTotals {
  std::array<int64_t, static_cast<int>(Phase::kCount)> ns{};
  int64_t pool_jobs = 0;   // jobs run on more than one thread
  int64_t solo_jobs = 0;   // parallel_for calls too small for more than one
};

// Starts (or stops) counting; starting clears the totals.
void profile_enable(bool on);
bool profile_enabled();
// The totals since profiling started.
ProfileTotals profile_totals();
void profile_count_job(bool pooled);
// Marks the calling thread as one of the pool's helpers: its scopes do not count.
void profile_mark_helper();

class ProfileScope {
 public:
  explicit ProfileScope(Phase phase);
  ~ProfileScope();
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  using Clock = std::chrono::steady_clock;
  Phase phase_;
  bool on_;
  Clock::time_point start_;
  ProfileScope* outer_ = nullptr;
};

}  // namespace tiny_llm
