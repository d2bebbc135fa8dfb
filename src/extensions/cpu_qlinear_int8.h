// The int8 kernel of quantized layers (the int8_activations option): x rounded to int8 per
// 32 values, integer products with the packed weights, one float multiply per lane.
// Private to cpu_qlinear.cpp, which includes it once: its definitions live in an
// anonymous namespace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_qlinear.h"
#include "cpu_qlinear_float.h"
#include "cpu_qlinear_formats.h"
#include "cpu_qlinear_lanes.h"

namespace tiny_llm {
namespace {

// ANCHOR: qlinear_int8_rows
// Int8 activations (the int8 option): each row of x rounded per 32 values to integers
// xq in -127 .. 127 with the scale sx = max|x| / 127 of those 32, so that a group's
// sum of q * x becomes a sum of products of small integers: exact in int32, whatever
// instructions compute it (AVX-512 VNNI's vpdpbusd does 64 of them in one instruction,
// AVX2's vpmaddubsw and vpmaddwd 32 in two), and one float multiply per lane after.
// Lane k of an output's sixteen holds bytes 4k .. 4k + 3 of each 64-byte block of the
// weight row (128 weights at 4 bits, both nibbles of each byte; 64 at 8): eight weights
// (four at 8 bits) of one group of 32. The row is read a unit at a time, the bytes of one
// register of lanes (kUnitBytes: a whole block with AVX-512, half of one with AVX2, a
// quarter with NEON or SSE), so a row that ends in part of a block (the default model's
// 576-wide 4-bit rows: four blocks and a half) ends on a whole unit where the registers
// are narrower. Staged once per call, zero past K: each unit's bytes of xq in the order
// of the packed bytes (at 4 bits the low nibbles' partners, then the high ones'), each
// lane's sx, and for the bias term each weight group's sum of the rounded x (sx * the sum
// of xq, over its 32s in order). The rounded sum, not x's own: then the whole product is
// W times the rounded x, whose error sum(w * (rounded - x)) is small because a row's
// weights are centred, where s * q alone is not.
constexpr int kBlockBytes = 64;  // sixteen lanes of four bytes
constexpr int kUnitBytes = 4 * kPartLanes;

class Int8Rows {
 public:
  Int8Rows(const float* x, int64_t M, int64_t K, QuantFormat format)
      : groups_(K / format.group), sum_vectors_((groups_ + 15) / 16),
        unit_weights_(format.bits == 4 ? 2 * kUnitBytes : kUnitBytes),
        units_((K + unit_weights_ - 1) / unit_weights_), whole_units_(K / unit_weights_),
        q_(static_cast<size_t>(M * units_ * unit_weights_), 0), sx_(M * units_),
        sums_(M * sum_vectors_) {
    const int64_t padded = units_ * unit_weights_, subgroups = (padded + 31) / 32;
    const int64_t group = format.group, lane_weights = unit_weights_ / kPartLanes;
    std::vector<int8_t> xq(subgroups * 32);
    std::vector<float> sx(subgroups);
    for (int64_t m = 0; m < M; ++m) {
      const float* row = x + m * K;
      std::fill(xq.begin(), xq.end(), 0);
      F16* sums = sums_.data() + m * sum_vectors_;
      for (int64_t g = 0; g < subgroups; ++g) {
        const int64_t end = std::min(K, g * 32 + 32);
        float amax = 0.0f;
        for (int64_t k = g * 32; k < end; ++k)
          amax = std::max(amax, std::fabs(row[k]));
        sx[g] = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int64_t k = g * 32; k < end; ++k)
          sum += xq[k] = static_cast<int8_t>(std::nearbyint(row[k] * inv));
        if (g * 32 < K) {  // std::fma: a compiler may fuse `+= a * b` on some targets only
          F16& group_sums = sums[g * 32 / group / 16];
          const int64_t lane = g * 32 / group % 16;
          group_sums.set(lane, std::fma(sx[g], static_cast<float>(sum), group_sums[lane]));
        }
      }
      int8_t* out = q_.data() + m * padded;
      for (int64_t u = 0; u < units_; ++u) {
        const int8_t* unit = xq.data() + u * unit_weights_;
        int8_t* staged = out + u * unit_weights_;
        for (int j = 0; j < kUnitBytes; ++j) {
          if (format.bits == 4)
            staged[j] = unit[2 * j], staged[kUnitBytes + j] = unit[2 * j + 1];
          else
            staged[j] = unit[j];
        }
        for (int k = 0; k < kPartLanes; ++k)
          sx_[m * units_ + u][k] = sx[(u * unit_weights_ + k * lane_weights) / 32];
      }
    }
    // A lane's weight group, from the unit's first: groups divide units or units groups.
    for (int k = 0; k < kPartLanes; ++k)
      lane_group_[k] = static_cast<int32_t>(k * lane_weights / group);
    for (int64_t u = 0; u <= units_; ++u) first_group_.push_back(u * unit_weights_ / group);
  }
  // Row m's staged xq (unit_weights() bytes a unit) and sx (one FloatPart a unit).
  const int8_t* q(int64_t m) const { return q_.data() + m * units_ * unit_weights_; }
  const FloatPart* sx(int64_t m) const { return sx_.data() + m * units_; }
  const F16* sums(int64_t m) const { return sums_.data() + m * sum_vectors_; }
  int64_t groups() const { return groups_; }
  int64_t units() const { return units_; }
  // Whole units of a row: its first row_bytes / kUnitBytes.
  int64_t whole_units() const { return whole_units_; }
  int64_t unit_weights() const { return unit_weights_; }
  const int64_t* first_groups() const { return first_group_.data(); }
  // Lane k of a unit: the scale (or any per-group value) of the weight group lane k reads,
  // from the unit's first group's at `first` (GROUPS of them, see kSpanning below).
  template <int GROUPS, typename S>
  SIMD_INLINE FloatPart unit_values(const S* first) const {
    if constexpr (GROUPS <= 1) {
      return to_float(*first) - FloatPart{};  // in every lane (exact, -0.0 included)
    } else {
#if defined(__AVX512F__)
      return _mm512_permutexvar_ps((__m512i)lane_group_,
                                   _mm512_castps128_ps512(first_values<GROUPS>(first)));
#elif defined(__AVX2__)
      return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(first_values<GROUPS>(first)),
                                      (__m256i)lane_group_);
#else
      FloatPart out;
      for (int k = 0; k < kPartLanes; ++k) out[k] = to_float(first[lane_group_[k]]);
      return out;
#endif
    }
  }

 private:
  int64_t groups_, sum_vectors_, unit_weights_, units_, whole_units_;
  std::vector<int8_t> q_;
  std::vector<FloatPart> sx_;
  std::vector<F16> sums_;
  IntPart lane_group_;
  std::vector<int64_t> first_group_;  // per unit and one past the last: its first weight group
};
// ANCHOR_END: qlinear_int8_rows

// ANCHOR: qlinear_int8_tile
// A unit of weight bytes as the integer products read it: its bytes (8 bits), or their low
// and high nibbles (4 bits).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
struct WeightUnit {
  __m512i part[2];
};

template <int BITS>
SIMD_INLINE WeightUnit unpack(const uint8_t* w) {
  const __m512i bytes = _mm512_loadu_si512(w);
  if constexpr (BITS == 8) return {{bytes, bytes}};
  const __m512i low4 = _mm512_set1_epi8(15);
  return {{_mm512_and_si512(bytes, low4), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4)}};
}

// Lane k: the sum of the products of bytes 4k .. 4k + 3 with the staged xq (vpdpbusd).
template <int BITS>
SIMD_INLINE IntPart products(const WeightUnit& w, const int8_t* xq) {
  __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.part[0], _mm512_loadu_si512(xq));
  if constexpr (BITS == 4)
    sum = _mm512_dpbusd_epi32(sum, w.part[1], _mm512_loadu_si512(xq + kUnitBytes));
  return (IntPart)sum;
}
#elif defined(__AVX2__)
// 32-byte pieces (one with AVX2's lanes, two in an AVX-512 build without VNNI). vpmaddubsw
// adds pairs of u8 * s8 products in int16, which holds 2 * 15 * 127 (4 bits) but not
// 2 * 255 * 127: at 8 bits the bytes go in as their low seven bits and their top bit, and
// the top bit's sums are shifted by 7. Exact either way.
constexpr int kPieces = kUnitBytes / 32;
struct WeightUnit {
  __m256i part[2][kPieces];  // [low nibbles or low seven bits; high nibbles or top bit][piece]
};

template <int BITS>
SIMD_INLINE WeightUnit unpack(const uint8_t* w) {
  WeightUnit out;
  for (int h = 0; h < kPieces; ++h) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
    if constexpr (BITS == 4) {
      const __m256i low4 = _mm256_set1_epi8(15);
      out.part[0][h] = _mm256_and_si256(bytes, low4);
      out.part[1][h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    } else {
      out.part[0][h] = _mm256_and_si256(bytes, _mm256_set1_epi8(127));
      out.part[1][h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 7), _mm256_set1_epi8(1));
    }
  }
  return out;
}

// Lane k: the sum of the products of bytes 4k .. 4k + 3 with the staged xq.
template <int BITS>
SIMD_INLINE IntPart products(const WeightUnit& w, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto pairs = [](__m256i bytes, const int8_t* x) {  // two bytes' products per int16 lane
    return _mm256_maddubs_epi16(bytes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  };
  __m256i sum[kPieces];
  for (int h = 0; h < kPieces; ++h) {
    if constexpr (BITS == 4)  // both nibbles' pairs added in int16 (at most 4 * 15 * 127)
      sum[h] = _mm256_madd_epi16(_mm256_add_epi16(pairs(w.part[0][h], xq + 32 * h),
                                                  pairs(w.part[1][h], xq + kUnitBytes + 32 * h)),
                                 ones);
    else
      sum[h] = _mm256_add_epi32(
          _mm256_madd_epi16(pairs(w.part[0][h], xq + 32 * h), ones),
          _mm256_slli_epi32(_mm256_madd_epi16(pairs(w.part[1][h], xq + 32 * h), ones), 7));
  }
#if defined(__AVX512F__)  // (AVX-512 without VNNI: one register of sixteen lanes)
  return (IntPart)_mm512_inserti64x4(_mm512_castsi256_si512(sum[0]), sum[1], 1);
#else
  return (IntPart)sum[0];
#endif
}
#else
struct WeightUnit {
  uint8_t part[2][kUnitBytes];
};

template <int BITS>
SIMD_INLINE WeightUnit unpack(const uint8_t* w) {
  WeightUnit out;
  for (int j = 0; j < kUnitBytes; ++j) {
    out.part[0][j] = BITS == 4 ? w[j] & 15 : w[j];
    out.part[1][j] = BITS == 4 ? w[j] >> 4 : 0;
  }
  return out;
}

template <int BITS>
SIMD_INLINE IntPart products(const WeightUnit& w, const int8_t* xq) {
  IntPart sum = {};
  for (int p = 0; p < (BITS == 4 ? 2 : 1); ++p)
    for (int j = 0; j < kUnitBytes; ++j)
      sum[j / 4] += static_cast<int32_t>(w.part[p][j]) * xq[p * kUnitBytes + j];
  return sum;
}
#endif

// Calls fn(std::integral_constant<int, P>) for the parts P = 0 .. kParts - 1 in order.
template <typename Fn, int... P>
SIMD_INLINE void each_part(Fn&& fn, std::integer_sequence<int, P...>) {
  (fn(std::integral_constant<int, P>{}), ...);
}

// How a unit's scales are found: GROUPS (1, 2 or 4) whole groups to a unit, unit u's
// first at u * GROUPS; or kSpanning, groups that span units, unit u's from a table.
constexpr int kSpanning = 0;

// One unit of MR rows of x (their staged xq and sx at the unit) against NR consecutive
// weight rows (w: the first one's unit, row_bytes apart; scales: the unit's first group's,
// `groups` apart), into part P of acc: acc += (float(sum of q * xq) * sx) * sw, lane by
// lane. A row's last unit, part of one, takes part_unit below.
template <int MR, int NR, int BITS, int GROUPS, int P, typename S>
SIMD_INLINE void int8_unit(const Int8Rows& rows, const int8_t* const (&xq)[MR],
                            const FloatPart* const (&sx)[MR], const uint8_t* w,
                            int64_t row_bytes, const S* scales, int64_t groups,
                            F16 (&acc)[MR][NR]) {
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const WeightUnit weights = unpack<BITS>(w + r * row_bytes);
    const FloatPart sw = rows.unit_values<GROUPS>(scales + r * groups);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      acc[i][r].part[P] = fma(
          __builtin_convertvector(products<BITS>(weights, xq[i]), FloatPart) * *sx[i], sw,
          acc[i][r].part[P]);
  }
}

// A row's last unit where the row holds only `bytes` of it and `count` of its groups: the
// same steps on copies padded with zeros (bytes and scales), one weight row at a time.
template <int MR, int NR, int BITS, int GROUPS, int P, typename S>
void part_unit(const Int8Rows& rows, const int8_t* const (&xq)[MR],
               const FloatPart* const (&sx)[MR], const uint8_t* w, int64_t row_bytes,
               const S* scales, int64_t groups, int bytes, int count, F16 (&acc)[MR][NR]) {
  for (int r = 0; r < NR; ++r) {
    uint8_t unit[kUnitBytes] = {};
    std::memcpy(unit, w + r * row_bytes, bytes);
    S values[4] = {};  // a unit's groups: at most 4
    std::copy(scales + r * groups, scales + r * groups + std::min(count, 4), values);
    F16 one[MR][1];
    for (int i = 0; i < MR; ++i) one[i][0] = acc[i][r];
    int8_unit<MR, 1, BITS, GROUPS, P>(rows, xq, sx, unit, 0, values, 0, one);
    for (int i = 0; i < MR; ++i) acc[i][r] = one[i][0];
  }
}

// MR rows of x against weight rows n0, n0 + NR, ... (as long as NR of them are left
// before n1), int8 activations: for NR rows at a time, acc over the units in order (unit u
// into part u % kParts), then y = sum_lanes(acc + bias), bias as in tile. The integer sums
// are exact and the float steps fixed, so the bits depend on K, the group size and the bit
// width only: the same in any tile, at any M and on any vector unit (a lane's products and
// steps do not depend on the register that holds it). NR > 1 shares each row's xq loads
// among the weight rows and keeps more chains in flight when there are few rows of x.
// Returns the first weight row not done.
template <int MR, int NR, int BITS, int GROUPS, typename S>
int64_t int8_tile(const Int8Rows& rows, int64_t m, int64_t n0, int64_t n1, const uint8_t* bytes,
                  int64_t row_bytes, const S* scales, const S* biases, float* y, int64_t ldy) {
  const int64_t groups = rows.groups(), step = rows.unit_weights(), units = rows.units();
  const int64_t whole_blocks = rows.whole_units() / kParts;
  const F16* sums[MR];
  for (int i = 0; i < MR; ++i) sums[i] = rows.sums(m + i);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const uint8_t* w = bytes + n * row_bytes;
    const S* s = scales + n * groups;  // the unit's first group's
    const int64_t* first = rows.first_groups();
    const int8_t* xq[MR];
    const FloatPart* sx[MR];
    F16 acc[MR][NR];
    for (int i = 0; i < MR; ++i) {
      xq[i] = rows.q(m + i), sx[i] = rows.sx(m + i);
      for (int r = 0; r < NR; ++r) acc[i][r] = F16{};
    }
    auto next = [&] {  // the pointers to the next unit
      w += kUnitBytes;
      if constexpr (GROUPS == kSpanning)
        s += first[1] - first[0], ++first;
      else
        s += GROUPS;
      for (int i = 0; i < MR; ++i) xq[i] += step, ++sx[i];
    };
    for (int64_t b = 0; b < whole_blocks; ++b) {  // 64-byte blocks: a unit into each part
      // Asked for 4 KiB ahead: this loop needs so few instructions a byte that, left to
      // the hardware prefetchers, it waits on memory (a tuned distance, on the 8-bit
      // vocabulary projection of one row).
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w + r * row_bytes + 4096);
      each_part([&](auto P) {
        int8_unit<MR, NR, BITS, GROUPS, decltype(P)::value>(rows, xq, sx, w, row_bytes, s,
                                                             groups, acc);
        next();
      }, std::make_integer_sequence<int, kParts>{});
    }
    // The units of the row's last block, part of one: whole ones, then part of a unit.
    each_part([&](auto P) {
      const int64_t u = whole_blocks * kParts + P;
      if (u >= units) return;
      const int64_t left = row_bytes - u * kUnitBytes;
      if (left >= kUnitBytes)
        int8_unit<MR, NR, BITS, GROUPS, decltype(P)::value>(rows, xq, sx, w, row_bytes, s,
                                                             groups, acc);
      else
        part_unit<MR, NR, BITS, GROUPS, decltype(P)::value>(
            rows, xq, sx, w, row_bytes, s, groups, static_cast<int>(left),
            static_cast<int>(scales + n * groups + groups - s), acc);
      if (u + 1 < units) next();
    }, std::make_integer_sequence<int, kParts>{});
    for (int r = 0; r < NR; ++r) {
      F16 bias[MR];
      bias_terms<MR>(biases + (n + r) * groups, sums, groups, bias);
      for (int i = 0; i < MR; ++i) y[i * ldy + n + r] = sum_lanes(acc[i][r] + bias[i]);
    }
  }
  return n;
}
// ANCHOR_END: qlinear_int8_tile

// Weight rows a single row of x takes at a time. With AVX-512 four (one register of
// accumulators each: one chain of multiply-adds alone waits on each link); with two or more
// registers to a row's lanes, one: one weight row after another streams better than four
// side by side (tuned on AVX2 with the default model's layers and 8-bit vocabulary
// projection; NEON and the plain build follow AVX2 untuned).
constexpr int kSingleRowWeights = kParts == 1 ? 4 : 1;

// Rows m0 .. m1 - 1 of x against the n1 weight rows at `bytes` (their scales and biases,
// their outputs y + n): tiles of four rows of x, the rows left over against two (three or
// two rows) or kSingleRowWeights (one row) weight rows at a time, then the last weight
// rows one by one.
template <int BITS, int GROUPS, typename S>
void int8_tiles(const Int8Rows& rows, int64_t m0, int64_t m1, int64_t n1, const uint8_t* bytes,
                int64_t row_bytes, const S* scales, const S* biases, float* y, int64_t N) {
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows)
    int8_tile<kTileRows, 1, BITS, GROUPS>(rows, m, 0, n1, bytes, row_bytes, scales, biases,
                                          y + m * N, N);
  auto rest = [&](auto wide, auto narrow) {
    narrow(rows, m, wide(rows, m, 0, n1, bytes, row_bytes, scales, biases, y + m * N, N), n1,
           bytes, row_bytes, scales, biases, y + m * N, N);
  };
  switch (m1 - m) {
    case 3: return rest(int8_tile<3, 2, BITS, GROUPS, S>, int8_tile<3, 1, BITS, GROUPS, S>);
    case 2: return rest(int8_tile<2, 2, BITS, GROUPS, S>, int8_tile<2, 1, BITS, GROUPS, S>);
    case 1: return rest(int8_tile<1, kSingleRowWeights, BITS, GROUPS, S>,
                        int8_tile<1, 1, BITS, GROUPS, S>);
    default: return;
  }
}

// The same, GROUPS chosen for the group size at BITS.
template <int BITS, typename S>
void int8_rows_against_weight_rows(const Int8Rows& rows, int64_t m0, int64_t m1, int64_t n1,
                                   const uint8_t* bytes, int64_t row_bytes, const S* scales,
                                   const S* biases, float* y, int64_t N, int group) {
  constexpr int unit_weights = (BITS == 4 ? 2 : 1) * kUnitBytes;
  if (group > unit_weights)
    return int8_tiles<BITS, kSpanning>(rows, m0, m1, n1, bytes, row_bytes, scales, biases, y, N);
  if constexpr (unit_weights >= 4 * 32)
    if (unit_weights / group == 4)
      return int8_tiles<BITS, 4>(rows, m0, m1, n1, bytes, row_bytes, scales, biases, y, N);
  if constexpr (unit_weights >= 2 * 32)
    if (unit_weights / group == 2)
      return int8_tiles<BITS, 2>(rows, m0, m1, n1, bytes, row_bytes, scales, biases, y, N);
  int8_tiles<BITS, 1>(rows, m0, m1, n1, bytes, row_bytes, scales, biases, y, N);
}

}  // namespace
}  // namespace tiny_llm
