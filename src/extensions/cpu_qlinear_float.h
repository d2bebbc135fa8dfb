// The float kernel of quantized layers: x staged once per call, then tiles of rows of x
// against one weight row at a time, from the packed bytes (the decode rows' default).
// Private to cpu_qlinear.cpp, which includes it once: its definitions live in an
// anonymous namespace.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_qlinear.h"
#include "cpu_qlinear_formats.h"
#include "cpu_qlinear_lanes.h"

namespace tiny_llm {
namespace {

constexpr int kBytesPerChunk = 16;  // one load of packed weights

// ANCHOR: qlinear_rows
// x as the kernel reads it, made once per call: each row as 16-lane vectors in the order
// of the packed bytes (at 4 bits, each 32 weights' even elements, then their odd ones),
// and each group's sum of x (for the bias term b * sum(x)), zero-padded to whole vectors.
class StagedRows {
 public:
  StagedRows(const float* x, int64_t M, int64_t K, QuantFormat format)
      : row_vectors_(K / 16), groups_(K / format.group), sum_vectors_((groups_ + 15) / 16),
        x_(M * row_vectors_), sums_(M * sum_vectors_) {
    const int64_t per_group = format.group / 16;
    for (int64_t m = 0; m < M; ++m) {
      const float* row = x + m * K;
      F16* out = x_.data() + m * row_vectors_;
      for (int64_t v = 0; v < row_vectors_; ++v)
        for (int l = 0; l < 16; ++l)
          out[v].set(l, format.bits == 4 ? row[v / 2 * 32 + 2 * l + v % 2] : row[v * 16 + l]);
      F16* sums = sums_.data() + m * sum_vectors_;
      for (int64_t g = 0; g < groups_; ++g) {
        F16 sum{};
        for (int64_t v = 0; v < per_group; ++v) sum += out[g * per_group + v];
        sums[g / 16].set(g % 16, sum_lanes(sum));
      }
    }
  }
  const F16* x(int64_t m) const { return x_.data() + m * row_vectors_; }
  const F16* sums(int64_t m) const { return sums_.data() + m * sum_vectors_; }
  int64_t groups() const { return groups_; }

 private:
  int64_t row_vectors_, groups_, sum_vectors_;
  std::vector<F16> x_, sums_;
};
// ANCHOR_END: qlinear_rows

// ANCHOR: qlinear_tile
// One group of one weight row against MR rows of x: v[i] = the lane-wise sum of q * x over
// the group's packed bytes, in order; the bytes are widened once for all MR rows.
template <int MR, int BITS>
SIMD_INLINE void group_sums(const uint8_t*& w, const F16* (&x)[MR], int chunks, F16 (&v)[MR]) {
  for (int i = 0; i < MR; ++i) v[i] = F16{};
  for (int c = 0; c < chunks; ++c, w += kBytesPerChunk) {
    const I16 q = load_bytes(w);
    if constexpr (BITS == 4) {
      const F16 even = to_floats(q & 15);
      const F16 odd = to_floats(q >> 4);
      for (int i = 0; i < MR; ++i) {
        v[i] = fma16(even, x[i][0], v[i]);
        v[i] = fma16(odd, x[i][1], v[i]);
        x[i] += 2;
      }
    } else {
      const F16 all = to_floats(q);
      for (int i = 0; i < MR; ++i) v[i] = fma16(all, *x[i]++, v[i]);
    }
  }
}

// bias[i] = the lane-wise b_g * sum_g(x) of row i over a weight row's groups, 16 at a time.
template <int MR, typename S>
SIMD_INLINE void bias_terms(const S* biases, const F16* const* sums, int64_t groups,
                       F16 (&bias)[MR]) {
  for (int i = 0; i < MR; ++i) bias[i] = F16{};
  for (int64_t j = 0; j * 16 < groups; ++j) {
    const F16 b = load_floats(biases + j * 16, static_cast<int>(std::min<int64_t>(16, groups - j * 16)));
    for (int i = 0; i < MR; ++i) bias[i] = fma16(b, sums[i][j], bias[i]);
  }
}

// MR rows of x against one weight row. y[m, n] = sum_lanes((even + odd) + bias), where
// even (odd) accumulates s_g * v_g over the even (odd) groups g in order, and bias is the
// lane-wise b_g * sum_g(x) over the groups, 16 at a time. Two accumulators keep two groups
// in flight (one chain of fused multiply-adds waits 4 cycles a link); nothing in it
// depends on MR or on the other rows. The scales are read sixteen at a time into float32
// (one conversion for sixteen groups where they are stored narrower).
template <int MR, int BITS, typename S>
void tile(const StagedRows& rows, int64_t m, const uint8_t* w, const S* scales, const S* biases,
          int chunks_per_group, float* y, int64_t ldy) {
  const int64_t groups = rows.groups();
  const F16 *x[MR], *sums[MR];
  F16 even[MR] = {}, odd[MR] = {}, v[MR];
  for (int i = 0; i < MR; ++i) x[i] = rows.x(m + i), sums[i] = rows.sums(m + i);
  // Blocks of sixteen groups, an even number: each group keeps its accumulator, even or odd.
  for (int64_t first = 0; first < groups; first += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, groups - first));
    float s[16];
    const F16 widened = load_floats(scales + first, count);
    std::memcpy(s, &widened, sizeof s);
    int g = 0;
    for (; g + 2 <= count; g += 2) {
      group_sums<MR, BITS>(w, x, chunks_per_group, v);
      for (int i = 0; i < MR; ++i) even[i] = fma16(splat(s[g]), v[i], even[i]);
      group_sums<MR, BITS>(w, x, chunks_per_group, v);
      for (int i = 0; i < MR; ++i) odd[i] = fma16(splat(s[g + 1]), v[i], odd[i]);
    }
    if (g < count) {  // the row's last group, an even one
      group_sums<MR, BITS>(w, x, chunks_per_group, v);
      for (int i = 0; i < MR; ++i) even[i] = fma16(splat(s[g]), v[i], even[i]);
    }
  }
  F16 bias[MR];
  bias_terms<MR>(biases, sums, groups, bias);
  for (int i = 0; i < MR; ++i) y[i * ldy] = sum_lanes((even[i] + odd[i]) + bias[i]);
}
// ANCHOR_END: qlinear_tile

constexpr int kTileRows = 4;

template <int BITS, typename S>
void rows_against_weight_row(const StagedRows& rows, int64_t m0, int64_t m1,
                             const uint8_t* w, const S* scales, const S* biases,
                             int chunks_per_group, float* y, int64_t N) {
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows)
    tile<kTileRows, BITS>(rows, m, w, scales, biases, chunks_per_group, y + m * N, N);
  switch (m1 - m) {
    case 3: return tile<3, BITS>(rows, m, w, scales, biases, chunks_per_group, y + m * N, N);
    case 2: return tile<2, BITS>(rows, m, w, scales, biases, chunks_per_group, y + m * N, N);
    case 1: return tile<1, BITS>(rows, m, w, scales, biases, chunks_per_group, y + m * N, N);
    default: return;
  }
}

}  // namespace
}  // namespace tiny_llm
