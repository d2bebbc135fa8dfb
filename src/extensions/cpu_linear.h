// The CPU matmul of the model's linear layers: y [M, N] = x [M, K] @ w [N, K]^T, float32.
//
// Each weight row is read from memory once per call for all M rows of x (a decode step
// streams the weights once, whatever its batch), and each output y[m, n] is one dot
// product computed the same way whatever M is: one 8-lane fused multiply-add accumulator
// over k = 0, 8, 16, ..., a fixed horizontal sum, then the K % 8 tail in order. A row's
// result therefore does not depend on which other rows share the call (batch invariance
// by construction, not by luck). Blocks of rows and weight rows run on the worker pool;
// how they are split never changes a result.
//
// One call may multiply x by several weight matrices of the same K (a layer's q, k and v
// projections, or its gate and up): their blocks share one run of the worker pool, so the
// pool starts once and a small matrix's few blocks do not leave a thread idle at its end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tiny_llm {

// One weight matrix of a call and where its product goes: y [M, N] = x [M, K] @ w [N, K]^T.
struct LinearPart {
  const float* w;
  float* y;
  int64_t N;
};

void linear_cpu(const float* x, const std::vector<LinearPart>& parts, int64_t M, int64_t K);

// A call's work items, numbered across its parts (its weight matrices): part p owns items
// first[p] .. first[p + 1] - 1. Returns the part of `item` and makes `item` its number
// within it (cpu_linear.cpp and cpu_qlinear.cpp share it).
inline size_t part_of(const std::vector<int64_t>& first, int64_t& item) {
  size_t p = 0;
  while (item >= first[p + 1]) ++p;
  item -= first[p];
  return p;
}

// The same product by the BLAS that MLX's matmul calls (OpenBLAS on Linux, on one thread),
// one call per block of weight rows, the blocks spread over the worker pool: both cores
// for prefill without OpenBLAS's own threads, which spin waiting for each other and
// collapse when another process holds a core. A block goes to whichever thread asks, so a
// thread kept off its core only takes fewer blocks. Linux only (kHasBlasSplit).
#if defined(__linux__)
constexpr bool kHasBlasSplit = true;
#else
constexpr bool kHasBlasSplit = false;
#endif
void linear_blas_split(const float* x, const std::vector<LinearPart>& parts, int64_t M,
                       int64_t K);

}  // namespace tiny_llm

#if defined(__linux__)
// MLX's own symbol: the OpenBLAS shim's when tiny_llm/kernels/blas.py has loaded it, else the
// reference BLAS of the mlx wheel. 101, 111, 112: CblasRowMajor, CblasNoTrans, CblasTrans.
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                            float alpha, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc);
#endif
