// Small kernels checking shim features against numpy: conversions, vectors,
// simd shuffles and prefix sums, simdgroup_matrix lane layout.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

[[kernel]] void convert(
    const device float* x [[buffer(0)]],
    device half* as_half [[buffer(1)]],
    device bfloat* as_bfloat [[buffer(2)]],
    device float* back [[buffer(3)]],
    uint i [[thread_position_in_grid]]) {
  as_half[i] = half(x[i]);
  as_bfloat[i] = bfloat(x[i]);
  back[i] = float(as_bfloat[i]) + float(as_half[i]);
}

[[kernel]] void vectors(
    const device float4* a [[buffer(0)]],
    const device float4* b [[buffer(1)]],
    device float* dots [[buffer(2)]],
    device float4* mix [[buffer(3)]],
    uint i [[thread_position_in_grid]]) {
  const float4 u = a[i];
  const float4 v = b[i];
  dots[i] = dot(u, v);
  float4 w = u * 2.0f - v;
  w += float4(1.0f, 2.0f, 3.0f, 4.0f);
  w.y = max(w.y, 0.0f);
  mix[i] = w;
}

[[kernel]] void shuffles(
    const device float* x [[buffer(0)]],
    device float* down [[buffer(1)]],
    device float* up [[buffer(2)]],
    device float* xr [[buffer(3)]],
    device float* excl [[buffer(4)]],
    device float* incl [[buffer(5)]],
    uint i [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const float v = x[i];
  down[i] = simd_shuffle_down(v, 3);
  up[i] = simd_shuffle_up(v, 5);
  xr[i] = simd_shuffle_xor(v, 6);
  excl[i] = simd_prefix_exclusive_sum(v);
  incl[i] = simd_prefix_inclusive_sum(v);
}

// Each lane reports the (row, column) of its first thread_elements() entry
// by loading a matrix whose element (r, c) is 8r + c.
[[kernel]] void matrix_layout(
    const device float* m [[buffer(0)]],
    device float* first [[buffer(1)]],
    device float* transposed [[buffer(2)]],
    uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_matrix<float, 8, 8> a;
  simdgroup_load(a, m, 8);
  first[lane] = a.thread_elements()[0];
  simdgroup_matrix<float, 8, 8> t;
  simdgroup_load(t, m, 8, ulong2(0, 0), true);
  simdgroup_store(t, transposed, 8);
}

// Every position attribute of every thread, 16 values per thread at its
// linear grid index.
[[kernel]] void positions(
    device uint* out [[buffer(0)]],
    uint3 gid [[thread_position_in_grid]],
    uint3 lid [[thread_position_in_threadgroup]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint3 tpg [[threads_per_threadgroup]],
    uint3 ngroups [[threadgroups_per_grid]],
    uint3 grid [[threads_per_grid]],
    ushort idx [[thread_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]],
    ushort sg [[simdgroup_index_in_threadgroup]],
    uint width [[threads_per_simdgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  const uint linear = (gid.z * grid.y + gid.y) * grid.x + gid.x;
  device uint* o = out + linear * 16;
  o[0] = gid.x;
  o[1] = gid.y;
  o[2] = gid.z;
  o[3] = tgid.x;
  o[4] = tgid.y;
  o[5] = tgid.z;
  o[6] = lid.x;
  o[7] = lid.y;
  o[8] = lid.z;
  o[9] = tpg.x * tpg.y * tpg.z;
  o[10] = ngroups.x * ngroups.y * ngroups.z;
  o[11] = idx;
  o[12] = lane;
  o[13] = sg;
  o[14] = width;
  o[15] = nsg;
}
