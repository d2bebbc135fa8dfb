// C = A @ B (row-major, float output) with simdgroup_matrix<.,8,8> tiles.
// A threadgroup of 64 threads (2 simdgroups) computes a 16x16 tile of C;
// simdgroup s owns rows 8s..8s+7 as two 8x8 accumulators. K is walked in
// steps of 16 through threadgroup tiles of A and B. M, N, K must be
// multiples of 16. Grid: threadgroups (N/16, M/16).
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

struct MatmulParams {
  int M;
  int N;
  int K;
};

template <typename T>
[[kernel]] void tiled_matmul(
    const device T* A [[buffer(0)]],
    const device T* B [[buffer(1)]],
    device float* C [[buffer(2)]],
    constant MatmulParams& p [[buffer(3)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup T As[16 * 16];
  threadgroup T Bs[16 * 16];
  threadgroup float Cs[2 * 8 * 16];
  const int row0 = group.y * 16;
  const int col0 = group.x * 16;
  simdgroup_matrix<float, 8, 8> acc0 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_matrix<float, 8, 8> acc1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (int k0 = 0; k0 < p.K; k0 += 16) {
    for (int i = tid; i < 256; i += 64) {
      const int r = i / 16;
      const int c = i % 16;
      As[i] = A[(row0 + r) * p.K + k0 + c];
      Bs[i] = B[(k0 + r) * p.N + col0 + c];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < 16; kk += 8) {
      simdgroup_matrix<T, 8, 8> a;
      simdgroup_matrix<T, 8, 8> b0;
      simdgroup_matrix<T, 8, 8> b1;
      simdgroup_load(a, As, 16, ulong2(kk, sg * 8));
      simdgroup_load(b0, Bs, 16, ulong2(0, kk));
      simdgroup_load(b1, Bs, 16, ulong2(8, kk));
      simdgroup_multiply_accumulate(acc0, a, b0, acc0);
      simdgroup_multiply_accumulate(acc1, a, b1, acc1);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // Epilogue: stage the simdgroup's 8x16 result in threadgroup memory, then
  // each lane copies elements other lanes stored.
  threadgroup float* cs = Cs + sg * 128;
  simdgroup_store(acc0, cs, 16);
  simdgroup_store(acc1, cs, 16, ulong2(8, 0));
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = lane; i < 128; i += 32) {
    C[(row0 + sg * 8 + i / 16) * p.N + col0 + i % 16] = cs[i];
  }
}

template [[host_name("tiled_matmul_float")]] [[kernel]] decltype(tiled_matmul<float>) tiled_matmul<float>;
template [[host_name("tiled_matmul_half")]] [[kernel]] decltype(tiled_matmul<half>) tiled_matmul<half>;
