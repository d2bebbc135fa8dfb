// The kernels' phase clocks (see profile.h).
#include "profile.h"

#include <atomic>

namespace tiny_llm {

namespace {

std::atomic<bool> g_on{false};
std::array<std::atomic<int64_t>, static_cast<int>(Phase::kCount)> g_ns{};
std::atomic<int64_t> g_pool_jobs{0}, g_solo_jobs{0};
thread_local ProfileScope* t_active = nullptr;  // this thread's innermost open scope
thread_local bool t_helper = false;

int64_t ns_between(std::chrono::steady_clock::time_point a,
                   std::chrono::steady_clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

}  // namespace

void profile_enable(bool on) {
  if (on) {
    for (auto& ns : g_ns) ns.store(0);
    g_pool_jobs.store(0);
    g_solo_jobs.store(0);
  }
  g_on.store(on);
}

bool profile_enabled() { return g_on.load(std::memory_order_relaxed); }

ProfileTotals profile_totals() {
  ProfileTotals totals;
  for (size_t i = 0; i < g_ns.size(); ++i) totals.ns[i] = g_ns[i].load();
  totals.pool_jobs = g_pool_jobs.load();
  totals.solo_jobs = g_solo_jobs.load();
  return totals;
}

void profile_count_job(bool pooled) {
  if (profile_enabled()) (pooled ? g_pool_jobs : g_solo_jobs).fetch_add(1);
}

void profile_mark_helper() { t_helper = true; }

ProfileScope::ProfileScope(Phase phase) : phase_(phase), on_(profile_enabled() && !t_helper) {
  if (!on_) return;
  start_ = Clock::now();
  outer_ = t_active;
  if (outer_) {  // the outer scope's clock pauses while this one runs
    g_ns[static_cast<int>(outer_->phase_)].fetch_add(ns_between(outer_->start_, start_),
                                                     std::memory_order_relaxed);
  }
  t_active = this;
}

ProfileScope::~ProfileScope() {
  if (!on_) return;
  const auto end = Clock::now();
  g_ns[static_cast<int>(phase_)].fetch_add(ns_between(start_, end), std::memory_order_relaxed);
  t_active = outer_;
  if (outer_) outer_->start_ = end;
}

}  // namespace tiny_llm
