// Interface between the Metal shim (compiled into each kernel translation
// unit) and the emulator runtime (runtime/runtime.cpp, a separate translation
// unit linked into the same shared object).
//
// This header must stay free of Metal keywords and of <cmath>/<cstdlib>: it is
// included by the kernel translation unit before the shim's keyword macros.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace mtl_emu {

// Position attributes of one simulated GPU thread. The runtime owns one per
// fiber and points `tl_thread` at the running fiber's record before every
// switch into it, so reading a position attribute is a plain load.
struct ThreadInfo {
  uint32_t pos_in_grid[3];
  uint32_t pos_in_tg[3];
  uint32_t tg_pos[3];
  uint32_t tg_size[3];    // size of this (possibly partial) threadgroup
  uint32_t n_groups[3];
  uint32_t grid_size[3];
  uint32_t index_in_tg;
  uint32_t lane;
  uint32_t simdgroup;
  uint32_t simd_width;    // 32
  uint32_t n_simdgroups;
};

// One simd collective, as seen by the lane that completes it. `in[i]`,
// `out[i]` and `arg[i]` are lane i's payload, result slot and scalar argument
// (valid only for lanes whose bit is set in `mask`). The payload and result
// live on the waiting lanes' own fiber stacks, which stay alive while they
// wait. Lanes are always combined in increasing lane order, so results do not
// depend on the schedule.
struct CollectiveView {
  int n;              // lanes in this simdgroup (32 unless the group is partial)
  uint32_t mask;      // lanes taking part (live lanes)
  const void* const* in;
  void* const* out;
  const int* arg;
};
using CombineFn = void (*)(const CollectiveView&);

extern thread_local const ThreadInfo* tl_thread;

// Buffer bound at `index` ([[buffer(index)]]); reports and aborts the run if
// the host did not bind it or it is smaller than `min_bytes`.
void* buffer_pointer(int index, size_t min_bytes, const char* what);
// Memory for a [[threadgroup(index)]] kernel parameter.
void* threadgroup_param(int index);
// Storage of the threadgroup variable declared at `site` (a per-declaration,
// per-instantiation unique address) for the running threadgroup.
void* threadgroup_alloc(const void* site, size_t bytes, size_t align, const char* file, int line);

void threadgroup_barrier(const char* file, int line);
// A simd collective: blocks until every live lane of the simdgroup reached the
// same call site, then the last lane runs `combine` (may be null: a plain
// simdgroup_barrier). `kind` names the operation in reports.
void collective(const void* in, void* out, int arg, CombineFn combine, const char* kind,
                const char* file, int line);

// Error classes, mapped to Python exception types by the harness.
enum ErrorKind : int {
  kOk = 0,
  kErrMemory = 1,   // out-of-bounds access, stack overflow, other faults
  kErrBarrier = 2,  // threadgroup_barrier misuse, deadlock
  kErrSimd = 3,     // simd collective / simdgroup_matrix misuse
  kErrOther = 4,    // binding, threadgroup-memory size, launch configuration
};

// Reports a kernel error for the running thread and ends the run.
[[noreturn]] void fail(int kind, const char* message);

// Static registration of kernels (generated at the end of each kernel file).
void register_kernel(const char* name, void (*fn)());

}  // namespace mtl_emu
