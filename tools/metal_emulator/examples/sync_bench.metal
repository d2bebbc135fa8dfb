// Synchronisation-heavy kernels used to measure the emulator's cost per
// thread per switch point (bench.py) and as smoke tests.
#include <metal_stdlib>
using namespace metal;

struct BenchParams {
  uint iters;
};

[[kernel]] void barrier_loop(
    device float* out [[buffer(0)]],
    constant BenchParams& p [[buffer(1)]],
    uint tid [[thread_position_in_grid]]) {
  float acc = 0.0f;
  for (uint i = 0; i < p.iters; ++i) {
    acc += float(i & 7u);
    threadgroup_barrier(mem_flags::mem_none);
  }
  out[tid] = acc;
}

[[kernel]] void simd_loop(
    device float* out [[buffer(0)]],
    constant BenchParams& p [[buffer(1)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  float acc = float(lane);
  for (uint i = 0; i < p.iters; ++i) {
    acc = simd_sum(acc) * (1.0f / 32.0f);
  }
  out[tid] = acc;
}
