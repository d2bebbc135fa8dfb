// Deliberately wrong kernels: each must be reported by the emulator (see
// tests/test_metal_emulator.py). Not part of the lint glob.
#include <metal_stdlib>
using namespace metal;

struct BigParams {
  uint a;
  uint b;
  uint c;
  uint d;
};

[[kernel]] void different_barriers(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // BARRIER_A
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // BARRIER_B
  }
  out[tid] = 1.0f;
}

[[kernel]] void barrier_vs_simd_deadlock(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  float x = 1.0f;
  if (lane < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    x = simd_sum(x);
  }
  out[tid] = x;
}

[[kernel]] void simd_divergence(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  float x = float(lane);
  if (lane < 16) {
    x = simd_sum(x);
  } else {
    x = simd_max(x);
  }
  out[tid] = x;
}

[[kernel]] void broadcast_not_uniform(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  out[tid] = simd_broadcast(float(lane), ushort(lane % 2));
}

[[kernel]] void threadgroup_overflow(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[32];
  t[tid + 1] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = t[tid];
}

[[kernel]] void threadgroup_too_big(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[9000];
  big[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[0];
}

[[kernel]] void reads_big_params(
    device float* out [[buffer(0)]],
    constant BigParams& p [[buffer(1)]],
    uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = float(p.d);
}

[[kernel]] void matrix_on_partial_simdgroup(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  simdgroup_matrix<float, 8, 8> a = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_matrix<float, 8, 8> c;
  simdgroup_multiply(c, a, a);
  out[tid] = c.thread_elements()[0];
}

[[kernel]] void write_past_end(
    device float* out [[buffer(0)]],
    uint tid [[thread_position_in_grid]]) {
  out[tid + 1] = 1.0f;
}

[[kernel]] void read_before_start(
    const device float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint tid [[thread_position_in_grid]]) {
  out[tid] = x[int(tid) - 1];
}
