// The CPU matmul of the linear layers (see cpu_linear.h).
#include "cpu_linear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu_simd.h"
#include "profile.h"
#include "worker_pool.h"

namespace tiny_llm {

namespace {

constexpr int kLanes = 8;

using namespace simd;  // Lanes8 and its operations (cpu_simd.h)

// Which lanes of a vector starting at k hold elements 0 <= k + lane < K: the first and
// last vectors of a row can be partial.
struct LaneRange {
  int lo, hi;  // lanes lo .. hi - 1
};

// ANCHOR: cpu_linear_plan
// Every dot product y[m, n] has one definition: lane l accumulates x[k] * w[k] for the k
// with k % 8 == l, in increasing k, one fused multiply-add each; the eight lanes are then
// summed in a fixed tree. Where the vectors start is free (it only decides which register
// lane holds which residue class, undone by the rotation before the sum), so they start
// where the weight rows are 32-byte aligned: MLX's buffers are not, and a load that
// straddles two cache lines costs more. Nothing in the definition depends on M, on the
// other rows, or on how the work is split.
struct DotPlan {
  int64_t first;  // k of the first vector: may be negative (its lanes below 0 are empty)
  int64_t count;  // vectors per row
  int64_t K;
  int rotation;   // register lane j holds residue class (j + rotation) % 8
};

DotPlan plan_dots(const float* w, int64_t K) {
  int lead = 0;  // elements before the first 32-byte boundary of every weight row
  const auto address = reinterpret_cast<std::uintptr_t>(w);
  if (K % kLanes == 0 && address % sizeof(float) == 0)
    lead = static_cast<int>((32 - address % 32) % 32 / sizeof(float));
  const int64_t first = lead == 0 ? 0 : lead - kLanes;
  return {first, (K - first + kLanes - 1) / kLanes, K, lead};
}

inline LaneRange lanes_at(const DotPlan& plan, int64_t k) {
  return {static_cast<int>(std::max<int64_t>(0, -k)),
          static_cast<int>(std::min<int64_t>(kLanes, plan.K - k))};
}
// ANCHOR_END: cpu_linear_plan

// ANCHOR: cpu_linear_tile
// MR rows of x against NR weight rows: MR * NR accumulators, so every weight vector
// loaded is used MR times and every x vector NR times. Each (row, weight row) pair has
// its own accumulator, so the tile's shape never changes a result. The loops over the tile
// are unrolled whole (MR, NR <= 8), so that acc lives in registers rather than memory.
template <int MR, int NR>
inline void tile_step(const float* x, const float* w, int64_t K, int64_t k, Lanes8 (&acc)[MR][NR],
                      const LaneRange* partial) {
  auto load = [partial](const float* p) {
    return partial ? load8(p, partial->lo, partial->hi) : load8(p);
  };
  Lanes8 wv[NR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    wv[j] = load(w + j * K + k);
    if constexpr (MR > 1) wv[j] = in_register(wv[j]);  // used MR times
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    Lanes8 xv = load(x + i * K + k);
    if constexpr (NR > 1) xv = in_register(xv);  // used NR times
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = fma(xv, wv[j], acc[i][j]);
  }
}

template <int MR, int NR>
inline void tile(const float* x, const float* w, float* y, int64_t ldy, const DotPlan& plan) {
  const int64_t K = plan.K;
  Lanes8 acc[MR][NR] = {};
  int64_t k = plan.first;
  const int64_t end = plan.first + plan.count * kLanes;
  const LaneRange head = lanes_at(plan, k);
  if (head.lo > 0 || head.hi < kLanes) {
    tile_step<MR, NR>(x, w, K, k, acc, &head);
    k += kLanes;
  }
  const int64_t full_end = k + (std::min(end, K) - k) / kLanes * kLanes;
  for (; k < full_end; k += kLanes) {
    // The next weight tile (the next NR rows) is on its way from memory meanwhile.
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) __builtin_prefetch(w + (NR + j) * K + k);
    tile_step<MR, NR>(x, w, K, k, acc, nullptr);
  }
  if (k < end) {
    const LaneRange tail = lanes_at(plan, k);
    tile_step<MR, NR>(x, w, K, k, acc, &tail);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = sum_tree(rotate(acc[i][j], plan.rotation));
}
// ANCHOR_END: cpu_linear_tile

// MR x NR accumulators, NR weight vectors and one x vector must all stay in registers: with
// AVX-512's 32 vector registers an 8 x 3 tile (28 of them) reuses each weight vector twice as
// often as a 4 x 3 one, which pays from 8 rows on.
// AVX2 (16 registers) and the plain code (on NEON a Lanes8 takes two of its 32) keep to 4 x 3.
// The bits are the same either way.
#if defined(__AVX512VL__)
constexpr int kTileRows = 8;     // MR: rows of x per tile
#else
constexpr int kTileRows = 4;
#endif
constexpr int kTileWeights = 3;  // NR: weight rows per tile
static_assert(kTileRows <= 8 && kTileWeights <= 8, "the tile's loops are unrolled 8 times");
// Up to this many rows, the weight rows are read one after another (tiles of NR = 1):
// memory-bound, a single forward stream per thread reads faster than three interleaved
// rows (an NR = 3 tile's pattern). Same accumulators in the same order, so the same bits;
// from 5 rows on the 4 x 3 tile's reuse of each x vector pays more (a tuned threshold).
constexpr int kRowByRow = 4;

// The last rows - m0 < kTileRows rows of x, one tile of exactly that many.
template <int MR, int NR>
void remainder_tile(const float* x, const float* w, float* y, int64_t rows, int64_t N,
                    const DotPlan& plan) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, NR>(x, w, y, N, plan);
    remainder_tile<MR - 1, NR>(x, w, y, rows, N, plan);
  }
}

// NR weight rows against rows m0 .. m1 - 1 of x.
template <int NR>
void weight_tile(const float* x, const float* w, float* y, int64_t m0, int64_t m1, int64_t N,
                 const DotPlan& plan) {
  const int64_t K = plan.K;
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows)
    tile<kTileRows, NR>(x + m * K, w, y + m * N, N, plan);
  remainder_tile<kTileRows - 1, NR>(x + m * K, w, y + m * N, m1 - m, N, plan);
}

// Rows m0 .. m1 - 1 of x against weight rows n0 .. n1 - 1, a few rows at a time (about
// 16 KiB of them, in L1). Weight tiles innermost: each is read from memory once, for the
// first rows, and from L2 for the next ones. `row_by_row`: tiles of one weight row (a call
// of at most kRowByRow rows).
void block(const float* x, const float* w, float* y, int64_t m0, int64_t m1, int64_t n0,
           int64_t n1, int64_t N, const DotPlan& plan, bool row_by_row) {
  const int64_t K = plan.K;
  const int64_t rows_in_l1 = std::max<int64_t>(
      kTileRows, 16384 / static_cast<int64_t>(sizeof(float) * std::max<int64_t>(K, 1)) /
                     kTileRows * kTileRows);
  for (int64_t m = m0; m < m1; m += rows_in_l1) {
    const int64_t m_end = std::min(m1, m + rows_in_l1);
    int64_t n = n0;
    if (!row_by_row)
      for (; n + kTileWeights <= n1; n += kTileWeights)
        weight_tile<kTileWeights>(x, w + n * K, y + n, m, m_end, N, plan);
    for (; n < n1; ++n) weight_tile<1>(x, w + n * K, y + n, m, m_end, N, plan);
  }
}

// x as each part's kernel reads it: its rows start where that part's weight rows do,
// modulo 32 bytes, so both load aligned (x itself, or a copy of it per such offset).
class StagedRows {
 public:
  StagedRows(const float* x, int64_t M, int64_t K) : x_(x), size_(M * K), K_(K) {}

  const float* for_weights(const float* w) {
    const auto offset = misalign(w);
    if (K_ % kLanes != 0 || offset == misalign(x_) || offset % sizeof(float) != 0) return x_;
    const float*& start = starts_[offset / sizeof(float)];
    if (start == nullptr) {
      auto& copy = copies_[offset / sizeof(float)];
      copy.resize(size_ + kLanes);
      float* at = copy.data();
      while (misalign(at) != offset) ++at;
      std::copy(x_, x_ + size_, at);
      start = at;
    }
    return start;
  }

 private:
  static std::uintptr_t misalign(const float* p) {
    return reinterpret_cast<std::uintptr_t>(p) % 32;
  }
  const float* x_;
  int64_t size_, K_;
  std::vector<float> copies_[kLanes];
  const float* starts_[kLanes] = {};
};

}  // namespace

// ANCHOR: cpu_linear
void linear_cpu(const float* x, const std::vector<LinearPart>& parts, int64_t M, int64_t K) {
  ProfileScope profile(Phase::kProjections);
  // A work item: up to 64 rows of x (in L2) against about 64 KiB of weight rows.
  constexpr int64_t block_rows = 64;
  const int64_t block_weights = std::max<int64_t>(
      kTileWeights, 65536 / static_cast<int64_t>(sizeof(float) * std::max<int64_t>(K, 1)) /
                        kTileWeights * kTileWeights);
  const int64_t m_blocks = (M + block_rows - 1) / block_rows;
  const double flops = 2.0 * std::min(M, block_rows) * block_weights * K;
  struct Job {
    const float* x;  // x's rows, aligned as this part's weight rows (StagedRows)
    DotPlan plan;
  };
  StagedRows rows(x, M, K);
  std::vector<Job> jobs;
  std::vector<int64_t> first{0};
  for (const auto& part : parts) {
    jobs.push_back({rows.for_weights(part.w), plan_dots(part.w, K)});
    first.push_back(first.back() + m_blocks * ((part.N + block_weights - 1) / block_weights));
  }
  // Weight blocks outermost: the blocks of one weight block's rows run back to back.
  parallel_for(static_cast<int>(first.back()), flops, [&](int index) {
    int64_t item = index;
    const size_t p = part_of(first, item);
    const LinearPart& part = parts[p];
    const int64_t nb = item / m_blocks, mb = item % m_blocks;
    block(jobs[p].x, part.w, part.y, mb * block_rows, std::min(M, (mb + 1) * block_rows),
          nb * block_weights, std::min(part.N, (nb + 1) * block_weights), part.N, jobs[p].plan,
          M <= kRowByRow);
  });
}
// ANCHOR_END: cpu_linear

// ANCHOR: cpu_linear_blas_split
void linear_blas_split(const float* x, const std::vector<LinearPart>& parts, int64_t M,
                       int64_t K) {
  ProfileScope profile(Phase::kProjections);
#if defined(__linux__)
  // About eight blocks of at least 64 weight rows per part: enough to share out unevenly,
  // few enough that repacking x for each call stays small next to the product.
  const auto block_of = [](int64_t N) {
    return std::max<int64_t>(64, (N + 7) / 8 + 15) / 16 * 16;
  };
  std::vector<int64_t> first{0};
  int64_t weight_rows = 0;
  for (const auto& part : parts) {
    first.push_back(first.back() + (part.N + block_of(part.N) - 1) / block_of(part.N));
    weight_rows += part.N;
  }
  if (first.back() == 0) return;  // every part has N = 0
  const double flops = 2.0 * M * K * weight_rows / static_cast<double>(first.back());
  parallel_for(static_cast<int>(first.back()), flops, [&](int index) {
    int64_t b = index;
    const LinearPart& part = parts[part_of(first, b)];
    const int64_t block = block_of(part.N);
    const int64_t n0 = b * block, n = std::min(part.N, n0 + block) - n0;
    cblas_sgemm(101, 111, 112, static_cast<int>(M), static_cast<int>(n), static_cast<int>(K),
                1.0f, x, static_cast<int>(K), part.w + n0 * K, static_cast<int>(K), 0.0f,
                part.y + n0, static_cast<int>(part.N));
  });
#else
  (void)x, (void)parts, (void)M, (void)K;
  throw std::runtime_error("linear_blas_split: Linux only");
#endif
}
// ANCHOR_END: cpu_linear_blas_split

}  // namespace tiny_llm
