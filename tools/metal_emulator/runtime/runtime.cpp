// CPU runtime of the Metal emulator: fibers for GPU threads, threadgroup
// barriers and simd collectives as the only switch points, schedules, guarded
// buffers and fault reports.
//
// Execution model (invariants the rest of the file relies on):
//  * A launch runs threadgroups one at a time on each worker OS thread (one
//    worker by default). Every GPU thread of the running threadgroup is a
//    fiber with its own stack; the worker's native stack runs the scheduler.
//  * A fiber runs uninterrupted from one synchronisation point to the next
//    (threadgroup_barrier, a simd_* collective, simdgroup_barrier, a
//    simdgroup_matrix multiply) and then always switches back to the
//    scheduler, which picks the next runnable fiber according to the
//    schedule. Nothing else preempts a fiber, so between sync points a thread
//    sees no interleaving; races show up as schedule-dependent results.
//  * A collective completes when every live (not returned) lane of the
//    simdgroup waits at the same call site; the last lane to arrive combines
//    the payloads in lane order. A barrier completes when every live thread of
//    the threadgroup waits at it; a thread that returns while others still
//    have to meet a barrier is an error.
//  * Device buffers are copies of the host arrays in memory with inaccessible
//    guard regions on both sides; threadgroup arrays each end at a guard page;
//    fiber stacks start above a guard page. A SIGSEGV in a guard region is
//    reported with the buffer and the thread and aborts the launch via
//    siglongjmp to the worker's scheduler frame.
#include "../shim/emu_abi.h"

#include <dlfcn.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define MTL_EMU_EXPORT extern "C" __attribute__((visibility("default")))

#if defined(__x86_64__) && !defined(MTL_EMU_UCONTEXT)
#define MTL_EMU_ASM_SWITCH 1
#else
#define MTL_EMU_ASM_SWITCH 0
#endif

#if MTL_EMU_ASM_SWITCH
// Saves the callee-saved registers and the stack pointer of the current
// context into *save_sp and resumes the context whose stack pointer is to_sp.
// Everything else is caller-saved in the System V ABI, so this is a complete
// context switch for code that leaves MXCSR and the x87 control word alone.
extern "C" void mtl_emu_switch(void** save_sp, void* to_sp);
// First code a new fiber runs: calls r13(r12) and never returns.
extern "C" void mtl_emu_fiber_stub();
asm(R"(
    .text
    .p2align 4
    .globl mtl_emu_switch
    .hidden mtl_emu_switch
    .type mtl_emu_switch,@function
mtl_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size mtl_emu_switch, .-mtl_emu_switch
    .p2align 4
    .globl mtl_emu_fiber_stub
    .hidden mtl_emu_fiber_stub
    .type mtl_emu_fiber_stub,@function
mtl_emu_fiber_stub:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size mtl_emu_fiber_stub, .-mtl_emu_fiber_stub
)");
#endif

namespace mtl_emu {

thread_local const ThreadInfo* tl_thread = nullptr;

namespace {

constexpr int kMaxBuffers = 32;
constexpr size_t kTgLimit = 32 * 1024;  // Apple GPUs: 32 KiB of threadgroup memory
constexpr int kMaxTgSlots = 16;
constexpr size_t kBufferGuard = 1 << 20;  // inaccessible bytes on each side of a buffer
constexpr int kMaxThreads = 1024;
constexpr size_t kStackGuardBelow = 4 << 20;  // inaccessible bytes below the lowest fiber stack

enum Schedule : int {
  kForward = 0,
  kReverse = 1,
  kRunAhead = 2,
  kRunAheadShuffled = 3,
  kRandom = 4,
};

enum FiberState : uint8_t { kRunnable, kWaitBarrier, kWaitSimd, kDone };

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// ---------------------------------------------------------------- registry

struct KernelEntry {
  const char* name;
  void (*fn)();
};
std::vector<KernelEntry>& registry() {
  static std::vector<KernelEntry> r;
  return r;
}

// ----------------------------------------------------------- launch state

struct BufferSlot {
  bool bound = false;
  char* data = nullptr;
  size_t size = 0;
  char* map = nullptr;
  size_t map_size = 0;
  std::string name;
};

struct LaunchConfig {
  const char* kernel_name = "";
  void (*kernel)() = nullptr;
  uint32_t grid_threads[3] = {1, 1, 1};  // threads per grid
  uint32_t tg[3] = {1, 1, 1};            // threads per (full) threadgroup
  uint32_t groups[3] = {1, 1, 1};
  int schedule = kForward;
  uint64_t seed = 0;
  size_t stack_bytes = 64 * 1024;
  uint32_t tg_param_bytes[kMaxBuffers] = {};
};

BufferSlot g_buffers[kMaxBuffers];
LaunchConfig g_cfg;
std::mutex g_launch_mutex;
std::mutex g_error_mutex;
std::string g_error;
int g_error_kind = kOk;
std::atomic<bool> g_abort{false};

void record_error(int kind, const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (g_error_kind == kOk) {
    g_error_kind = kind;
    g_error = msg;
  }
  g_abort.store(true);
}

// ----------------------------------------------------------------- fibers

struct Fiber {
#if MTL_EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
  ThreadInfo info{};
  FiberState state = kDone;
  int index = 0;
  // Where the fiber waits (barrier or collective) and the collective payload.
  const char* file = nullptr;
  int line = 0;
  const char* kind = nullptr;
  CombineFn combine = nullptr;
  const void* c_in = nullptr;
  void* c_out = nullptr;
  int c_arg = 0;
  char* stack_lo = nullptr;  // lowest usable byte (a guard page lies below)
};

struct SimdState {
  int first = 0;  // fiber index of lane 0
  int n = 0;      // lanes
  int live = 0;   // lanes not returned
  int arrived = 0;
  const char* file = nullptr;
  int line = 0;
  const char* kind = nullptr;
  CombineFn combine = nullptr;
};

struct TgSlot {
  const void* site = nullptr;
  char* ptr = nullptr;
  size_t bytes = 0;
  char* hi = nullptr;  // end of the slot's accessible region; a guard page follows
  const char* file = "";
  int line = 0;
};

struct Worker {
  std::vector<Fiber> fibers;
  int n = 0;  // threads in the running threadgroup
  SimdState sg[kMaxThreads / 32];
  int n_sg = 0;
  int live = 0;
  int done = 0;
  int first_done = -1;
  int at_barrier = 0;
  const char* bar_file = nullptr;
  int bar_line = 0;
  int bar_first = -1;

  // Runnable set (swap-remove array) plus the schedule's cursor state.
  std::vector<int> runnable;
  std::vector<int> rpos;
  int cursor = 0;
  int cur_sg = 0;
  std::vector<int> sg_order;
  uint64_t rng = 0;

#if MTL_EMU_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched_uc;
#endif
  Fiber* cur = nullptr;
  bool failed = false;
  volatile bool in_kernel = false;
  sigjmp_buf jb;

  char* stack_map = nullptr;
  size_t stack_map_size = 0;
  size_t stack_stride = 0;

  char* tg_map = nullptr;
  size_t tg_map_size = 0;
  TgSlot tg[kMaxTgSlots];
  int n_tg = 0;
  size_t tg_total = 0;
  char* tg_param[kMaxBuffers] = {};

  char* alt_stack = nullptr;
  stack_t old_alt{};
  uint32_t group[3] = {0, 0, 0};
};

thread_local Worker* tl_worker = nullptr;

std::string describe(const Fiber& f) {
  const ThreadInfo& t = f.info;
  return format("thread (%u,%u,%u) of threadgroup (%u,%u,%u) [simdgroup %u lane %u, grid position (%u,%u,%u)]",
                t.pos_in_tg[0], t.pos_in_tg[1], t.pos_in_tg[2], t.tg_pos[0], t.tg_pos[1],
                t.tg_pos[2], t.simdgroup, t.lane, t.pos_in_grid[0], t.pos_in_grid[1],
                t.pos_in_grid[2]);
}

std::string site(const char* file, int line) { return format("%s:%d", file ? file : "?", line); }

bool same_site(const char* fa, int la, const char* fb, int lb) {
  return la == lb && (fa == fb || (fa && fb && std::strcmp(fa, fb) == 0));
}

void make_runnable(Worker& w, int i) {
  Fiber& f = w.fibers[i];
  f.state = kRunnable;
  w.rpos[i] = static_cast<int>(w.runnable.size());
  w.runnable.push_back(i);
}

void make_blocked(Worker& w, int i, FiberState s) {
  Fiber& f = w.fibers[i];
  f.state = s;
  int p = w.rpos[i];
  int last = w.runnable.back();
  w.runnable[p] = last;
  w.rpos[last] = p;
  w.runnable.pop_back();
}

// Fiber -> scheduler. Returns when the scheduler resumes this fiber.
inline void yield_to_scheduler(Worker& w, Fiber& f) {
#if MTL_EMU_ASM_SWITCH
  mtl_emu_switch(&f.sp, w.sched_sp);
#else
  swapcontext(&f.uc, &w.sched_uc);
#endif
}

// Scheduler -> fiber.
inline void resume_fiber(Worker& w, Fiber& f) {
  w.cur = &f;
  tl_thread = &f.info;
#if MTL_EMU_ASM_SWITCH
  mtl_emu_switch(&w.sched_sp, f.sp);
#else
  swapcontext(&w.sched_uc, &f.uc);
#endif
}

[[noreturn]] void fail_in_fiber(Worker& w, int kind, const std::string& msg) {
  Fiber& f = *w.cur;
  record_error(kind, format("kernel '%s': %s\n  in %s", g_cfg.kernel_name, msg.c_str(),
                            describe(f).c_str()));
  w.failed = true;
  for (;;) yield_to_scheduler(w, f);  // the scheduler never resumes a failed run
}

void complete_collective(Worker& w, int s);

void fiber_finish(Worker& w, Fiber& f) {
  make_blocked(w, f.index, kDone);
  w.live--;
  w.done++;
  if (w.first_done < 0) w.first_done = f.index;
  SimdState& g = w.sg[f.info.simdgroup];
  g.live--;
  if (w.at_barrier > 0) {
    fail_in_fiber(w, kErrBarrier,
                  format("returned while %d thread(s) of its threadgroup wait at threadgroup_barrier "
                         "%s (first: %s); every thread must reach every barrier (a return before a "
                         "barrier?)",
                         w.at_barrier, site(w.bar_file, w.bar_line).c_str(),
                         describe(w.fibers[w.bar_first]).c_str()));
  }
  if (g.arrived > 0 && g.arrived == g.live) complete_collective(w, static_cast<int>(f.info.simdgroup));
}

void fiber_main(Fiber* f) {
  Worker& w = *tl_worker;
  g_cfg.kernel();
  fiber_finish(w, *f);
  for (;;) yield_to_scheduler(w, *f);
}

#if !MTL_EMU_ASM_SWITCH
void fiber_entry_ucontext() { fiber_main(tl_worker->cur); }
#endif

void init_fiber_context(Worker& w, Fiber& f) {
  char* top = f.stack_lo + g_cfg.stack_bytes;
#if MTL_EMU_ASM_SWITCH
  // Frame popped by mtl_emu_switch: r15 r14 r13 r12 rbx rbp, then the return
  // address (the stub). After `ret`, rsp == top - 16 (16-byte aligned), so the
  // stub's call enters fiber_main with the ABI's alignment.
  void** sp = reinterpret_cast<void**>(top - 72);
  sp[0] = nullptr;                                           // r15
  sp[1] = nullptr;                                           // r14
  sp[2] = reinterpret_cast<void*>(&fiber_main);              // r13
  sp[3] = &f;                                                // r12
  sp[4] = nullptr;                                           // rbx
  sp[5] = nullptr;                                           // rbp
  sp[6] = reinterpret_cast<void*>(&mtl_emu_fiber_stub);      // return address
  f.sp = sp;
  (void)w;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack_lo;
  f.uc.uc_stack.ss_size = g_cfg.stack_bytes;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, &fiber_entry_ucontext, 0);
  (void)w;
#endif
}

// --------------------------------------------------------------- schedules

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int pick_next(Worker& w) {
  if (w.runnable.empty()) return -1;
  switch (g_cfg.schedule) {
    case kForward:
      for (;;) {
        int j = w.cursor;
        w.cursor = j + 1 == w.n ? 0 : j + 1;
        if (w.fibers[j].state == kRunnable) return j;
      }
    case kReverse:
      for (;;) {
        int j = w.cursor;
        w.cursor = j == 0 ? w.n - 1 : j - 1;
        if (w.fibers[j].state == kRunnable) return j;
      }
    case kRunAhead:
    case kRunAheadShuffled: {
      // Drain the current simdgroup (lowest runnable lane first) before
      // moving on to the next simdgroup in `sg_order`.
      for (int k = 0; k < w.n_sg; ++k) {
        int s = w.sg_order[(w.cur_sg + k) % w.n_sg];
        const SimdState& g = w.sg[s];
        for (int l = 0; l < g.n; ++l) {
          if (w.fibers[g.first + l].state == kRunnable) {
            w.cur_sg = (w.cur_sg + k) % w.n_sg;
            return g.first + l;
          }
        }
      }
      return -1;
    }
    default:
      return w.runnable[splitmix(w.rng) % w.runnable.size()];
  }
}

// -------------------------------------------------------- synchronisation

void complete_collective(Worker& w, int s) {
  SimdState& g = w.sg[s];
  const void* in[32];
  void* out[32];
  int arg[32];
  uint32_t mask = 0;
  for (int l = 0; l < g.n; ++l) {
    Fiber& f = w.fibers[g.first + l];
    in[l] = nullptr;
    out[l] = nullptr;
    arg[l] = 0;
    if (f.state == kWaitSimd) {
      mask |= 1u << l;
      in[l] = f.c_in;
      out[l] = f.c_out;
      arg[l] = f.c_arg;
    }
  }
  CombineFn fn = g.combine;
  g.arrived = 0;
  if (fn) fn(CollectiveView{g.n, mask, in, out, arg});
  for (int l = 0; l < g.n; ++l) {
    if (mask >> l & 1u) make_runnable(w, g.first + l);
  }
}

std::string waiting_summary(Worker& w) {
  // Groups waiting threads by (state, site) for deadlock reports.
  std::string out;
  std::vector<bool> seen(static_cast<size_t>(w.n), false);
  for (int i = 0; i < w.n; ++i) {
    Fiber& f = w.fibers[i];
    if (seen[i] || (f.state != kWaitBarrier && f.state != kWaitSimd)) continue;
    int count = 0;
    for (int j = i; j < w.n; ++j) {
      Fiber& o = w.fibers[j];
      if (!seen[j] && o.state == f.state && same_site(o.file, o.line, f.file, f.line) &&
          (f.state == kWaitBarrier || o.info.simdgroup == f.info.simdgroup)) {
        seen[j] = true;
        count++;
      }
    }
    if (f.state == kWaitBarrier) {
      out += format("\n  %d thread(s) wait at threadgroup_barrier %s (first: %s)", count,
                    site(f.file, f.line).c_str(), describe(f).c_str());
    } else {
      out += format("\n  %d lane(s) of simdgroup %u wait at %s %s (first: %s)", count,
                    f.info.simdgroup, f.kind, site(f.file, f.line).c_str(), describe(f).c_str());
    }
  }
  if (w.done > 0) {
    out += format("\n  %d thread(s) returned (first: %s)", w.done,
                  describe(w.fibers[w.first_done]).c_str());
  }
  return out;
}

// ------------------------------------------------------------ threadgroups

void prepare_group(Worker& w, const uint32_t gpos[3]) {
  uint32_t size[3];
  for (int d = 0; d < 3; ++d) {
    uint32_t start = gpos[d] * g_cfg.tg[d];
    uint32_t rest = g_cfg.grid_threads[d] - start;
    size[d] = rest < g_cfg.tg[d] ? rest : g_cfg.tg[d];
    w.group[d] = gpos[d];
  }
  w.n = static_cast<int>(size[0] * size[1] * size[2]);
  w.n_sg = (w.n + 31) / 32;
  w.runnable.clear();
  w.rpos.assign(static_cast<size_t>(w.n), -1);
  for (int i = 0; i < w.n; ++i) {
    Fiber& f = w.fibers[i];
    ThreadInfo& t = f.info;
    uint32_t u = static_cast<uint32_t>(i);
    t.pos_in_tg[0] = u % size[0];
    t.pos_in_tg[1] = (u / size[0]) % size[1];
    t.pos_in_tg[2] = u / (size[0] * size[1]);
    for (int d = 0; d < 3; ++d) {
      t.tg_pos[d] = gpos[d];
      t.tg_size[d] = size[d];
      t.n_groups[d] = g_cfg.groups[d];
      t.grid_size[d] = g_cfg.grid_threads[d];
      t.pos_in_grid[d] = gpos[d] * g_cfg.tg[d] + t.pos_in_tg[d];
    }
    t.index_in_tg = u;
    t.lane = u % 32;
    t.simdgroup = u / 32;
    t.simd_width = 32;
    t.n_simdgroups = static_cast<uint32_t>(w.n_sg);
    f.index = i;
    f.file = nullptr;
    f.line = 0;
    init_fiber_context(w, f);
    make_runnable(w, i);
  }
  for (int s = 0; s < w.n_sg; ++s) {
    SimdState& g = w.sg[s];
    g.first = s * 32;
    g.n = (w.n - s * 32) < 32 ? (w.n - s * 32) : 32;
    g.live = g.n;
    g.arrived = 0;
  }
  w.live = w.n;
  w.done = 0;
  w.first_done = -1;
  w.at_barrier = 0;
  w.failed = false;
  w.n_tg = 0;
  w.tg_total = 0;

  uint64_t glin = (static_cast<uint64_t>(gpos[2]) * g_cfg.groups[1] + gpos[1]) * g_cfg.groups[0] + gpos[0];
  w.rng = g_cfg.seed * 0x100000001B3ull ^ (glin + 1) * 0x9E3779B97F4A7C15ull;
  splitmix(w.rng);
  w.cursor = g_cfg.schedule == kReverse ? w.n - 1 : 0;
  w.cur_sg = 0;
  w.sg_order.resize(static_cast<size_t>(w.n_sg));
  for (int s = 0; s < w.n_sg; ++s) w.sg_order[s] = s;
  if (g_cfg.schedule == kRunAheadShuffled) {
    for (int s = w.n_sg - 1; s > 0; --s) {
      int j = static_cast<int>(splitmix(w.rng) % static_cast<uint64_t>(s + 1));
      int t = w.sg_order[s];
      w.sg_order[s] = w.sg_order[j];
      w.sg_order[j] = t;
    }
  }

  // [[threadgroup(n)]] parameters get the first slots, poisoned like arrays.
  for (int b = 0; b < kMaxBuffers; ++b) {
    w.tg_param[b] = nullptr;
    if (g_cfg.tg_param_bytes[b] == 0) continue;
    size_t bytes = round_up(g_cfg.tg_param_bytes[b], 16);
    TgSlot& s = w.tg[w.n_tg++];
    s.site = nullptr;
    s.bytes = bytes;
    s.ptr = s.hi - bytes;
    s.file = "[[threadgroup]] parameter";
    s.line = b;
    std::memset(s.ptr, 0xFF, bytes);
    w.tg_total += bytes;
    w.tg_param[b] = s.ptr;
  }
}

// Runs one threadgroup to completion. Returns false if the run failed.
bool run_group(Worker& w, const uint32_t gpos[3]) {
  prepare_group(w, gpos);
  if (w.tg_total > kTgLimit) {
    record_error(kErrOther, format("kernel '%s': [[threadgroup(n)]] parameters need %zu bytes, "
                                   "more than the 32 KiB of threadgroup memory",
                                   g_cfg.kernel_name, w.tg_total));
    return false;
  }
  while (w.live > 0) {
    int i = pick_next(w);
    if (i < 0) {
      record_error(kErrBarrier,
                   format("kernel '%s': deadlock in threadgroup (%u,%u,%u): no thread can run%s",
                          g_cfg.kernel_name, gpos[0], gpos[1], gpos[2], waiting_summary(w).c_str()));
      return false;
    }
    resume_fiber(w, w.fibers[i]);
    if (w.failed) return false;
  }
  return true;
}

bool run_group_guarded(Worker& w, const uint32_t gpos[3]) {
  if (sigsetjmp(w.jb, 1) != 0) {
    w.in_kernel = false;
    return false;
  }
  w.in_kernel = true;
  bool ok = run_group(w, gpos);
  w.in_kernel = false;
  return ok;
}

// ---------------------------------------------------------- fault reports

struct sigaction g_old_actions[65];
const int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE};

std::string classify_address(Worker& w, uintptr_t a, bool is_write) {
  const char* rw = is_write ? "write" : "read";
  for (int b = 0; b < kMaxBuffers; ++b) {
    const BufferSlot& s = g_buffers[b];
    if (!s.bound) continue;
    uintptr_t lo = reinterpret_cast<uintptr_t>(s.map);
    uintptr_t hi = lo + s.map_size;
    if (a < lo || a >= hi) continue;
    uintptr_t d = reinterpret_cast<uintptr_t>(s.data);
    long long off = static_cast<long long>(a) - static_cast<long long>(d);
    return format("out-of-bounds %s of buffer(%d) '%s' at byte offset %lld (%s; the buffer holds "
                  "%zu bytes)",
                  rw, b, s.name.c_str(), off, off < 0 ? "before its start" : "past its end",
                  s.size);
  }
  for (int k = 0; k < w.n_tg; ++k) {
    const TgSlot& s = w.tg[k];
    uintptr_t hi = reinterpret_cast<uintptr_t>(s.hi);
    if (a >= hi && a < hi + page_size()) {
      return format("out-of-bounds %s of threadgroup array declared at %s:%d, %llu bytes past its "
                    "end (it holds %zu bytes)",
                    rw, s.file, s.line, static_cast<unsigned long long>(a - hi), s.bytes);
    }
  }
  uintptr_t st = reinterpret_cast<uintptr_t>(w.stack_map);
  if (a >= st && a < st + w.stack_map_size) {
    return format("stack overflow (each GPU thread has a %zu KiB stack; pass stack_kb= to the "
                  "harness for more)",
                  g_cfg.stack_bytes / 1024);
  }
  return format("invalid memory %s at address %p (not next to any bound buffer)", rw,
                reinterpret_cast<void*>(a));
}

std::string describe_pc(void* pc) {
  Dl_info info;
  if (dladdr(pc, &info) && info.dli_fbase) {
    return format(" [pc %s+0x%lx]", info.dli_fname ? info.dli_fname : "?",
                  static_cast<unsigned long>(reinterpret_cast<uintptr_t>(pc) -
                                             reinterpret_cast<uintptr_t>(info.dli_fbase)));
  }
  return "";
}

void on_fault(int sig, siginfo_t* si, void* uctx) {
  Worker* w = tl_worker;
  if (w == nullptr || !w->in_kernel) {
    // Not ours: restore the previous handler and let the fault repeat.
    sigaction(sig, &g_old_actions[sig], nullptr);
    return;
  }
  w->in_kernel = false;
  void* pc = nullptr;
  bool is_write = false;
#if defined(__x86_64__)
  auto* uc = static_cast<ucontext_t*>(uctx);
  pc = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]);
  is_write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
  (void)uctx;
#endif
  std::string what;
  int kind = kErrMemory;
  if (sig == SIGFPE) {
    what = "arithmetic fault (integer division by zero?)";
  } else {
    what = classify_address(*w, reinterpret_cast<uintptr_t>(si->si_addr), is_write);
  }
  std::string who = w->cur ? describe(*w->cur) : std::string("the scheduler");
  record_error(kind, format("kernel '%s': %s\n  in %s%s", g_cfg.kernel_name, what.c_str(),
                            who.c_str(), describe_pc(pc).c_str()));
  siglongjmp(w->jb, 1);
}

void install_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = &on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int s : kFaultSignals) sigaction(s, &sa, &g_old_actions[s]);
}

void restore_handlers() {
  for (int s : kFaultSignals) sigaction(s, &g_old_actions[s], nullptr);
}

// ----------------------------------------------------------------- workers

bool worker_setup(Worker& w, int max_threads) {
  size_t ps = page_size();
  w.fibers.resize(static_cast<size_t>(max_threads));
  // [kStackGuardBelow inaccessible][guard page, stack] per fiber: an overflow
  // of the lowest stack faults in the region below instead of foreign memory.
  w.stack_stride = g_cfg.stack_bytes + ps;
  w.stack_map_size = kStackGuardBelow + w.stack_stride * static_cast<size_t>(max_threads);
  void* m = mmap(nullptr, w.stack_map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return false;
  w.stack_map = static_cast<char*>(m);
  mprotect(w.stack_map, kStackGuardBelow, PROT_NONE);
  for (int i = 0; i < max_threads; ++i) {
    char* base = w.stack_map + kStackGuardBelow + w.stack_stride * static_cast<size_t>(i);
    mprotect(base, ps, PROT_NONE);
    w.fibers[i].stack_lo = base + ps;
  }
  // Threadgroup memory: kMaxTgSlots slots of 32 KiB, each followed by a guard page.
  size_t slot = kTgLimit + ps;
  w.tg_map_size = ps + slot * kMaxTgSlots;
  m = mmap(nullptr, w.tg_map_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return false;
  w.tg_map = static_cast<char*>(m);
  for (int k = 0; k < kMaxTgSlots; ++k) {
    char* lo = w.tg_map + ps + slot * static_cast<size_t>(k);
    mprotect(lo, kTgLimit, PROT_READ | PROT_WRITE);
    w.tg[k].hi = lo + kTgLimit;
  }
  // Alternate signal stack so that stack overflows can be reported.
  size_t alt = 256 * 1024;
  w.alt_stack = static_cast<char*>(mmap(nullptr, alt, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  stack_t ss;
  ss.ss_sp = w.alt_stack;
  ss.ss_size = alt;
  ss.ss_flags = 0;
  sigaltstack(&ss, &w.old_alt);
  return true;
}

void worker_teardown(Worker& w) {
  sigaltstack(&w.old_alt, nullptr);
  if (w.alt_stack) munmap(w.alt_stack, 256 * 1024);
  if (w.stack_map) munmap(w.stack_map, w.stack_map_size);
  if (w.tg_map) munmap(w.tg_map, w.tg_map_size);
}

void worker_loop(std::atomic<uint64_t>* next, uint64_t total, int max_threads) {
  Worker w;
  tl_worker = &w;
  if (!worker_setup(w, max_threads)) {
    record_error(kErrOther, "could not map fiber stacks");
  } else {
    for (;;) {
      if (g_abort.load()) break;
      uint64_t g = next->fetch_add(1);
      if (g >= total) break;
      uint32_t gpos[3];
      gpos[0] = static_cast<uint32_t>(g % g_cfg.groups[0]);
      gpos[1] = static_cast<uint32_t>((g / g_cfg.groups[0]) % g_cfg.groups[1]);
      gpos[2] = static_cast<uint32_t>(g / (static_cast<uint64_t>(g_cfg.groups[0]) * g_cfg.groups[1]));
      if (!run_group_guarded(w, gpos)) break;
    }
  }
  worker_teardown(w);
  tl_worker = nullptr;
  tl_thread = nullptr;
}

void free_buffers() {
  for (BufferSlot& s : g_buffers) {
    if (s.map) munmap(s.map, s.map_size);
    s = BufferSlot();
  }
}

}  // namespace

// ------------------------------------------------------- ABI for the shim

void* buffer_pointer(int index, size_t min_bytes, const char* what) {
  Worker& w = *tl_worker;
  if (index < 0 || index >= kMaxBuffers || !g_buffers[index].bound) {
    fail_in_fiber(w, kErrOther, format("buffer(%d) is not bound", index));
  }
  const BufferSlot& s = g_buffers[index];
  if (s.size < min_bytes) {
    fail_in_fiber(w, kErrOther,
                  format("buffer(%d) '%s' holds %zu bytes but the kernel reads it as %s of %zu bytes",
                         index, s.name.c_str(), s.size, what, min_bytes));
  }
  return s.data;
}

void* threadgroup_param(int index) {
  Worker& w = *tl_worker;
  if (index < 0 || index >= kMaxBuffers || w.tg_param[index] == nullptr) {
    fail_in_fiber(w, kErrOther,
                  format("[[threadgroup(%d)]] has no size: pass threadgroup_memory={%d: nbytes}",
                         index, index));
  }
  return w.tg_param[index];
}

void* threadgroup_alloc(const void* key, size_t bytes, size_t align, const char* file, int line) {
  Worker& w = *tl_worker;
  for (int k = 0; k < w.n_tg; ++k) {
    if (w.tg[k].site == key) return w.tg[k].ptr;
  }
  if (w.n_tg >= kMaxTgSlots) {
    fail_in_fiber(w, kErrOther, format("more than %d threadgroup arrays (%s:%d)", kMaxTgSlots, file, line));
  }
  if (w.tg_total + bytes > kTgLimit) {
    fail_in_fiber(w, kErrOther,
                  format("threadgroup array at %s:%d (%zu bytes) brings threadgroup memory to %zu "
                         "bytes, more than 32 KiB",
                         file, line, bytes, w.tg_total + bytes));
  }
  TgSlot& s = w.tg[w.n_tg++];
  s.site = key;
  s.bytes = bytes;
  s.ptr = s.hi - round_up(bytes, align);
  s.file = file;
  s.line = line;
  std::memset(s.ptr, 0xFF, bytes);  // NaN for float/half, -1 for signed ints
  w.tg_total += bytes;
  return s.ptr;
}

void threadgroup_barrier(const char* file, int line) {
  Worker& w = *tl_worker;
  Fiber& f = *w.cur;
  if (w.done > 0) {
    fail_in_fiber(w, kErrBarrier,
                  format("reached threadgroup_barrier %s after %d thread(s) of its threadgroup "
                         "returned (first: %s); every thread must reach every barrier (a return "
                         "before a barrier?)",
                         site(file, line).c_str(), w.done, describe(w.fibers[w.first_done]).c_str()));
  }
  if (w.at_barrier == 0) {
    w.bar_file = file;
    w.bar_line = line;
    w.bar_first = f.index;
  } else if (!same_site(file, line, w.bar_file, w.bar_line)) {
    fail_in_fiber(w, kErrBarrier,
                  format("threads wait at different barriers: this thread at threadgroup_barrier %s, "
                         "%d other(s) at threadgroup_barrier %s (first: %s)",
                         site(file, line).c_str(), w.at_barrier, site(w.bar_file, w.bar_line).c_str(),
                         describe(w.fibers[w.bar_first]).c_str()));
  }
  f.file = file;
  f.line = line;
  make_blocked(w, f.index, kWaitBarrier);
  if (++w.at_barrier == w.live) {
    w.at_barrier = 0;
    for (int i = 0; i < w.n; ++i) {
      if (w.fibers[i].state == kWaitBarrier) make_runnable(w, i);
    }
  }
  yield_to_scheduler(w, f);
}

void collective(const void* in, void* out, int arg, CombineFn combine, const char* kind,
                const char* file, int line) {
  Worker& w = *tl_worker;
  Fiber& f = *w.cur;
  SimdState& g = w.sg[f.info.simdgroup];
  if (g.arrived == 0) {
    g.file = file;
    g.line = line;
    g.kind = kind;
    g.combine = combine;
  } else if (!same_site(file, line, g.file, g.line) || combine != g.combine) {
    int other = -1;
    for (int l = 0; l < g.n; ++l) {
      if (w.fibers[g.first + l].state == kWaitSimd) {
        other = g.first + l;
        break;
      }
    }
    fail_in_fiber(w, kErrSimd,
                  format("simdgroup divergence: this lane calls %s at %s while %d lane(s) of its "
                         "simdgroup wait at %s %s (first: %s); simd collectives need "
                         "simdgroup-uniform control flow",
                         kind, site(file, line).c_str(), g.arrived, g.kind,
                         site(g.file, g.line).c_str(), describe(w.fibers[other]).c_str()));
  }
  f.file = file;
  f.line = line;
  f.kind = kind;
  f.combine = combine;
  f.c_in = in;
  f.c_out = out;
  f.c_arg = arg;
  make_blocked(w, f.index, kWaitSimd);
  if (++g.arrived == g.live) complete_collective(w, static_cast<int>(f.info.simdgroup));
  yield_to_scheduler(w, f);
}

void fail(int kind, const char* message) {
  Worker& w = *tl_worker;
  const Fiber& f = *w.cur;
  if (f.state == kWaitSimd) {  // raised while combining a collective: name its call site
    fail_in_fiber(w, kind, format("%s (at %s %s)", message, f.kind, site(f.file, f.line).c_str()));
  }
  fail_in_fiber(w, kind, message);
}

void register_kernel(const char* name, void (*fn)()) { registry().push_back({name, fn}); }

}  // namespace mtl_emu

// ---------------------------------------------------------- host C ABI

using namespace mtl_emu;

struct MtlEmuBuffer {
  int32_t index;
  int32_t poison;  // 1: fill with 0xFF (NaN) instead of copying from host
  const char* name;
  void* host;
  uint64_t size;        // the buffer's bytes, as the kernel sees them
  uint64_t host_offset; // where the host's bytes lie in the buffer
  uint64_t host_size;   // the host's bytes: size, or fewer for a sparse buffer (the rest
                        // reads as zero and costs no memory until written)
};

MTL_EMU_EXPORT int mtl_emu_kernel_count() { return static_cast<int>(registry().size()); }

MTL_EMU_EXPORT const char* mtl_emu_kernel_name(int i) {
  if (i < 0 || i >= static_cast<int>(registry().size())) return nullptr;
  return registry()[static_cast<size_t>(i)].name;
}

MTL_EMU_EXPORT const char* mtl_emu_error() { return g_error.c_str(); }

MTL_EMU_EXPORT const char* mtl_emu_context_switch() {
  return MTL_EMU_ASM_SWITCH ? "x86-64 assembly" : "ucontext";
}

// Runs `kernel` over the grid. grid_is_threads: `grid` counts threads
// (dispatchThreads; the last threadgroups may be partial), else threadgroups
// (dispatchThreadgroups). align_start: place buffers against their leading
// guard instead of the trailing one. Returns an ErrorKind; mtl_emu_error()
// has the report.
MTL_EMU_EXPORT int mtl_emu_launch(const char* kernel, const MtlEmuBuffer* bufs, int nbufs,
                                  const uint32_t* tg_param_bytes, const uint32_t* grid,
                                  const uint32_t* tg, int grid_is_threads, int schedule,
                                  uint64_t seed, int workers, uint32_t stack_kb,
                                  int align_start) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  g_error.clear();
  g_error_kind = kOk;
  g_abort.store(false);
  g_cfg = LaunchConfig();
  g_cfg.kernel_name = kernel;
  for (const KernelEntry& e : registry()) {
    if (std::strcmp(e.name, kernel) == 0) g_cfg.kernel = e.fn;
  }
  if (!g_cfg.kernel) {
    record_error(kErrOther, format("no kernel named '%s' in this file", kernel));
    return g_error_kind;
  }
  uint64_t threads = 1;
  for (int d = 0; d < 3; ++d) {
    if (tg[d] == 0 || grid[d] == 0) {
      record_error(kErrOther, "grid and threadgroup sizes must be positive");
      return g_error_kind;
    }
    threads *= tg[d];
    g_cfg.tg[d] = tg[d];
    if (grid_is_threads) {
      g_cfg.grid_threads[d] = grid[d];
      g_cfg.groups[d] = (grid[d] + tg[d] - 1) / tg[d];
    } else {
      g_cfg.groups[d] = grid[d];
      g_cfg.grid_threads[d] = grid[d] * tg[d];
    }
  }
  if (threads > static_cast<uint64_t>(kMaxThreads)) {
    record_error(kErrOther, format("threadgroup of %llu threads: Metal allows at most %d",
                                   static_cast<unsigned long long>(threads), kMaxThreads));
    return g_error_kind;
  }
  g_cfg.schedule = schedule;
  g_cfg.seed = seed;
  g_cfg.stack_bytes = round_up(static_cast<size_t>(stack_kb ? stack_kb : 64) * 1024, page_size());
  for (int b = 0; b < kMaxBuffers; ++b) g_cfg.tg_param_bytes[b] = tg_param_bytes ? tg_param_bytes[b] : 0;

  // Guarded copies of the host buffers: data ends exactly where the trailing
  // guard region begins, so the first byte past the end faults (or, with
  // align_start, starts exactly where the leading guard ends, so the first
  // byte before the start faults). The slack in the partly used page is
  // filled with 0xFF so that reads of it produce NaN / -1.
  size_t ps = page_size();
  for (int i = 0; i < nbufs; ++i) {
    const MtlEmuBuffer& b = bufs[i];
    if (b.index < 0 || b.index >= kMaxBuffers || g_buffers[b.index].bound) {
      record_error(kErrOther, format("bad or duplicate buffer index %d", b.index));
      free_buffers();
      return g_error_kind;
    }
    BufferSlot& s = g_buffers[b.index];
    size_t body = round_up(b.size ? b.size : 1, ps);
    s.map_size = kBufferGuard + body + kBufferGuard;
    void* m = mmap(nullptr, s.map_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      record_error(kErrOther, "could not map a guarded buffer");
      free_buffers();
      return g_error_kind;
    }
    s.map = static_cast<char*>(m);
    mprotect(s.map + kBufferGuard, body, PROT_READ | PROT_WRITE);
    s.data = align_start ? s.map + kBufferGuard : s.map + kBufferGuard + body - b.size;
    // The slack on either side of the data, within its pages (never a sparse buffer's body).
    std::memset(s.map + kBufferGuard, 0xFF, static_cast<size_t>(s.data - s.map - kBufferGuard));
    std::memset(s.data + b.size, 0xFF, body - b.size - (s.data - s.map - kBufferGuard));
    s.size = b.size;
    s.name = b.name ? b.name : "";
    s.bound = true;
    if (b.host_offset + b.host_size > b.size) {
      record_error(kErrOther, format("buffer %d: host bytes past the buffer's end", b.index));
      free_buffers();
      return g_error_kind;
    }
    if (b.poison) {
      std::memset(s.data, 0xFF, b.size);
    } else if (b.host_size) {
      std::memcpy(s.data + b.host_offset, b.host, b.host_size);
    }
  }

  uint64_t total = static_cast<uint64_t>(g_cfg.groups[0]) * g_cfg.groups[1] * g_cfg.groups[2];
  std::atomic<uint64_t> next{0};
  int nw = workers < 1 ? 1 : workers;
  if (static_cast<uint64_t>(nw) > total) nw = static_cast<int>(total);
  install_handlers();
  {
    std::vector<std::thread> pool;
    for (int k = 1; k < nw; ++k) {
      pool.emplace_back(worker_loop, &next, total, static_cast<int>(threads));
    }
    worker_loop(&next, total, static_cast<int>(threads));
    for (std::thread& t : pool) t.join();
  }
  restore_handlers();

  for (int i = 0; i < nbufs; ++i) {
    const MtlEmuBuffer& b = bufs[i];
    if (b.host_size) std::memcpy(b.host, g_buffers[b.index].data + b.host_offset, b.host_size);
  }
  free_buffers();
  return g_error_kind;
}
