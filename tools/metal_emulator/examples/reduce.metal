// Block reduction: each threadgroup reduces one contiguous chunk of x to its
// (scaled) sum and its max. Exercises simd_sum / simd_max / simd_broadcast,
// threadgroup arrays, threadgroup_barrier, a [[threadgroup(n)]] parameter and
// template instantiation through [[host_name]].
#include <metal_stdlib>
using namespace metal;

struct ReduceParams {
  uint n;          // elements of x
  uint per_group;  // elements reduced by one threadgroup
  float scale;     // applied to each sum
};

template <typename T>
[[kernel]] void block_reduce(
    const device T* x [[buffer(0)]],
    device float* sums [[buffer(1)]],
    device float* maxes [[buffer(2)]],
    constant ReduceParams& p [[buffer(3)]],
    uint group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint ntid [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float part_sum[32];
  threadgroup float part_max[32];
  const uint begin = group * p.per_group;
  const uint end = min(begin + p.per_group, p.n);
  float s = 0.0f;
  float m = -FLT_MAX;
  for (uint i = begin + tid; i < end; i += ntid) {
    const float v = float(x[i]);
    s += v;
    m = max(m, v);
  }
  s = simd_sum(s);
  m = simd_max(m);
  if (lane == 0) {
    part_sum[sg] = s;
    part_max[sg] = m;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    s = lane < nsg ? part_sum[lane] : 0.0f;
    m = lane < nsg ? part_max[lane] : -FLT_MAX;
    s = simd_sum(s);
    m = simd_broadcast(simd_max(m), 0);
    if (lane == 0) {
      sums[group] = s * p.scale;
      maxes[group] = m;
    }
  }
}

template [[host_name("block_reduce_float")]] [[kernel]] decltype(block_reduce<float>) block_reduce<float>;
template [[host_name("block_reduce_half")]] [[kernel]] decltype(block_reduce<half>) block_reduce<half>;

// Sum of each threadgroup's chunk through threadgroup memory sized by the host
// ([[threadgroup(0)]]: one float per thread), tree-reduced with barriers.
[[kernel]] void tree_sum(
    const device float* x [[buffer(0)]],
    device float* sums [[buffer(1)]],
    constant ReduceParams& p [[buffer(2)]],
    threadgroup float* scratch [[threadgroup(0)]],
    uint group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint ntid [[threads_per_threadgroup]]) {
  const uint begin = group * p.per_group;
  const uint end = min(begin + p.per_group, p.n);
  float s = 0.0f;
  for (uint i = begin + tid; i < end; i += ntid) {
    s += x[i];
  }
  scratch[tid] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = ntid / 2; stride > 0; stride /= 2) {
    if (tid < stride) {
      scratch[tid] += scratch[tid + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) {
    sums[group] = scratch[0] * p.scale;
  }
}
