// The CPU matmul of quantized linear layers (see cpu_qlinear.h).
#include "cpu_qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "cpu_linear.h"
#include "worker_pool.h"

namespace tiny_llm {

namespace {

// ANCHOR: qlinear_lanes
// Sixteen float (or int32) lanes, held in the target's own vector registers: one AVX-512
// register, two AVX2 ones, four NEON or SSE ones. Held as one 64-byte GCC vector instead,
// a target without 64-byte registers kept every value on the stack and called a function
// for each multiply-add: on AVX2 the kernel read its weights many times slower than the
// float32 kernel does (the book's performance appendix). The arithmetic below is lane by
// lane (and what combines lanes, sum_lanes and the integer products, does so in a fixed
// order), so the bits are the same whatever holds the lanes.
#if defined(__AVX512F__)
constexpr int kPartLanes = 16;
#elif defined(__AVX2__)
constexpr int kPartLanes = 8;
#else
constexpr int kPartLanes = 4;
#endif
constexpr int kParts = 16 / kPartLanes;
typedef float FloatPart __attribute__((vector_size(4 * kPartLanes)));
typedef int32_t IntPart __attribute__((vector_size(4 * kPartLanes)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));

// Inlined always: a call would pass the lanes through memory.
#define LANES_INLINE inline __attribute__((always_inline))

// Sixteen packed bytes widen to sixteen int32 lanes (I16): 32 weights at 4 bits (byte j
// holds weights 2j and 2j + 1 of its 32), 16 at 8 bits; F16 holds sixteen floats.
struct F16 {
  FloatPart part[kParts];
  LANES_INLINE float operator[](int i) const { return part[i / kPartLanes][i % kPartLanes]; }
  LANES_INLINE void set(int i, float v) { part[i / kPartLanes][i % kPartLanes] = v; }
};

struct I16 {
  IntPart part[kParts];
  LANES_INLINE int32_t operator[](int i) const { return part[i / kPartLanes][i % kPartLanes]; }
  LANES_INLINE void set(int i, int32_t v) { part[i / kPartLanes][i % kPartLanes] = v; }
};
// ANCHOR_END: qlinear_lanes

LANES_INLINE F16 operator+(F16 a, const F16& b) {
  for (int p = 0; p < kParts; ++p) a.part[p] += b.part[p];
  return a;
}
LANES_INLINE F16& operator+=(F16& a, const F16& b) { return a = a + b; }
LANES_INLINE I16 operator&(I16 a, int32_t mask) {
  for (int p = 0; p < kParts; ++p) a.part[p] &= mask;
  return a;
}
LANES_INLINE I16 operator>>(I16 a, int shift) {
  for (int p = 0; p < kParts; ++p) a.part[p] >>= shift;
  return a;
}
LANES_INLINE F16 to_floats(const I16& q) {
  F16 out;
  for (int p = 0; p < kParts; ++p) out.part[p] = __builtin_convertvector(q.part[p], FloatPart);
  return out;
}

// a * b + c rounded once, lane by lane. Spelled out because `a * b + c` leaves the choice
// to the compiler, which may fuse it in one place and not in another: every output must
// take the same operations whatever tile computes it.
LANES_INLINE FloatPart fma_part(FloatPart a, FloatPart b, FloatPart c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return (FloatPart)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  for (int i = 0; i < kPartLanes; ++i) c[i] = std::fma(a[i], b[i], c[i]);
  return c;
#endif
}

LANES_INLINE F16 fma16(const F16& a, const F16& b, F16 c) {
  for (int p = 0; p < kParts; ++p) c.part[p] = fma_part(a.part[p], b.part[p], c.part[p]);
  return c;
}

LANES_INLINE F16 splat(float v) {
  F16 out;
  for (int p = 0; p < kParts; ++p) out.part[p] = v - FloatPart{};  // exact, -0.0 included
  return out;
}

// The sixteen lanes summed in a fixed tree: lane i + 8 onto lane i, then i + 4, i + 2, i + 1.
LANES_INLINE float sum_lanes(const F16& v) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v.part[0]),
                                  _mm512_extractf32x8_ps(v.part[0], 1));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m256 s8 = _mm256_add_ps(v.part[0], v.part[1]);
#endif
#if (defined(__AVX512F__) && defined(__AVX512DQ__)) || (defined(__AVX2__) && !defined(__AVX512F__))
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  float s[16];
  std::memcpy(s, &v, sizeof s);
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) s[i] += s[i + width];
  return s[0];
#endif
}

// The first `count` (1 .. 16) floats at p, the other lanes zero; nothing past them is read.
LANES_INLINE F16 load_floats(const float* p, int count) {
  F16 out{};
#if defined(__AVX512F__)
  out.part[0] = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), p);
#else
  std::memcpy(&out, p, sizeof(float) * count);
#endif
  return out;
}

// Sixteen bytes zero-extended to int32 lanes (the generic conversion compiles to byte-by-byte
// moves, hence the instructions where the target has them).
LANES_INLINE I16 load_bytes(const uint8_t* p) {
  I16 out;
#if defined(__AVX512F__)
  out.part[0] = (IntPart)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  out.part[0] = (IntPart)_mm256_cvtepu8_epi32(bytes);
  out.part[1] = (IntPart)_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
#else
  U8x16 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  for (int i = 0; i < 16; ++i) out.part[i / kPartLanes][i % kPartLanes] = bytes[i];
#endif
  return out;
}

constexpr int kBytesPerChunk = 16;  // one load of packed weights

// ANCHOR: qlinear_scales
// Scales and biases as stored: float, or the bits of a float16 or bfloat16 value. Every
// float16 and bfloat16 value is a float32 value, so widening them where they are read is
// exact: the same products as from float32 copies, from half the bytes.
struct Float16Bits {
  uint16_t bits;
};
struct BFloat16Bits {
  uint16_t bits;
};

inline float to_float(float v) { return v; }

inline float to_float(Float16Bits v) {
#if defined(__F16C__) && defined(__AVX2__)
  return _cvtsh_ss(v.bits);
#else
  // Sign, then the exponent rebiased from 15 to 127 and the 10 mantissa bits moved up 13;
  // a subnormal's mantissa shifted up until it is normal; infinities and NaNs kept.
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  uint32_t exponent = (v.bits >> 10) & 0x1fu, mantissa = v.bits & 0x3ffu, bits = sign;
  if (exponent == 0x1f) {
    bits |= 0x7f800000u | mantissa << 13;
  } else if (exponent != 0) {
    bits |= (exponent + 112) << 23 | mantissa << 13;
  } else if (mantissa != 0) {
    for (exponent = 113; !(mantissa & 0x400u); mantissa <<= 1) --exponent;
    bits |= exponent << 23 | (mantissa & 0x3ffu) << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

inline float to_float(BFloat16Bits v) {  // the top half of a float32's bits
  const uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// load_floats of values stored narrower: the first `count` (1 .. 16), widened.
template <typename S>
LANES_INLINE F16 load_floats(const S* p, int count) {
  static_assert(sizeof(S) == 2, "float32 values take load_floats(const float*, int)");
  F16 out{};
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i bits = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), p);
  if constexpr (std::is_same_v<S, Float16Bits>)
    out.part[0] = _mm512_cvtph_ps(bits);
  else
    out.part[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return out;
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)  // two registers
  S part[16];
  if (count < 16) {  // a row's last groups: from a copy padded with zero bits (0.0)
    for (int i = 0; i < 16; ++i) part[i] = i < count ? p[i] : S{};
    p = part;
  }
  for (int h = 0; h < 2; ++h) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h));
    if constexpr (std::is_same_v<S, Float16Bits>)
      out.part[h] = _mm256_cvtph_ps(bits);
    else
      out.part[h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  return out;
#else
  for (int i = 0; i < count; ++i) out.set(i, to_float(p[i]));
  return out;
#endif
}

#if defined(__AVX2__)
// The first N (2 or 4) values at p as floats in the low lanes (nothing past them is read).
template <int N, typename S>
LANES_INLINE __m128 first_values(const S* p) {
  static_assert(N == 2 || N == 4, "two or four values");
  if constexpr (std::is_same_v<S, float>) {
    if constexpr (N == 4) return _mm_loadu_ps(p);
    double two;
    std::memcpy(&two, p, sizeof two);
    return _mm_castpd_ps(_mm_set_sd(two));
  } else {
    int64_t raw = 0;
    std::memcpy(&raw, p, N * sizeof(S));
    const __m128i bits = _mm_cvtsi64_si128(raw);
#if defined(__F16C__)
    if constexpr (std::is_same_v<S, Float16Bits>) return _mm_cvtph_ps(bits);
#endif
    if constexpr (std::is_same_v<S, BFloat16Bits>)
      return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));
    alignas(16) float v[4] = {};
    for (int i = 0; i < N; ++i) v[i] = to_float(p[i]);
    return _mm_load_ps(v);
  }
}
#endif

// fn(scales, biases): the part's, as pointers to the type they are stored in.
template <typename Fn>
void with_scales(const QuantizedPart& part, Fn&& fn) {
  switch (part.scale_type) {
    case ScaleType::f16:
      return fn(static_cast<const Float16Bits*>(part.scales),
                static_cast<const Float16Bits*>(part.biases));
    case ScaleType::bf16:
      return fn(static_cast<const BFloat16Bits*>(part.scales),
                static_cast<const BFloat16Bits*>(part.biases));
    default:
      return fn(static_cast<const float*>(part.scales), static_cast<const float*>(part.biases));
  }
}
// ANCHOR_END: qlinear_scales

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
LANES_INLINE void group_sums(const uint8_t*& w, const F16* (&x)[MR], int chunks, F16 (&v)[MR]) {
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
LANES_INLINE void bias_terms(const S* biases, const F16* const* sums, int64_t groups,
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
  LANES_INLINE FloatPart unit_values(const S* first) const {
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
LANES_INLINE WeightUnit unpack(const uint8_t* w) {
  const __m512i bytes = _mm512_loadu_si512(w);
  if constexpr (BITS == 8) return {{bytes, bytes}};
  const __m512i low4 = _mm512_set1_epi8(15);
  return {{_mm512_and_si512(bytes, low4), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4)}};
}

// Lane k: the sum of the products of bytes 4k .. 4k + 3 with the staged xq (vpdpbusd).
template <int BITS>
LANES_INLINE IntPart products(const WeightUnit& w, const int8_t* xq) {
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
LANES_INLINE WeightUnit unpack(const uint8_t* w) {
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
LANES_INLINE IntPart products(const WeightUnit& w, const int8_t* xq) {
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
LANES_INLINE WeightUnit unpack(const uint8_t* w) {
  WeightUnit out;
  for (int j = 0; j < kUnitBytes; ++j) {
    out.part[0][j] = BITS == 4 ? w[j] & 15 : w[j];
    out.part[1][j] = BITS == 4 ? w[j] >> 4 : 0;
  }
  return out;
}

template <int BITS>
LANES_INLINE IntPart products(const WeightUnit& w, const int8_t* xq) {
  IntPart sum = {};
  for (int p = 0; p < (BITS == 4 ? 2 : 1); ++p)
    for (int j = 0; j < kUnitBytes; ++j)
      sum[j / 4] += static_cast<int32_t>(w.part[p][j]) * xq[p * kUnitBytes + j];
  return sum;
}
#endif

// Calls fn(std::integral_constant<int, P>) for the parts P = 0 .. kParts - 1 in order.
template <typename Fn, int... P>
LANES_INLINE void each_part(Fn&& fn, std::integer_sequence<int, P...>) {
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
LANES_INLINE void int8_unit(const Int8Rows& rows, const int8_t* const (&xq)[MR],
                            const FloatPart* const (&sx)[MR], const uint8_t* w,
                            int64_t row_bytes, const S* scales, int64_t groups,
                            F16 (&acc)[MR][NR]) {
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const WeightUnit weights = unpack<BITS>(w + r * row_bytes);
    const FloatPart sw = rows.unit_values<GROUPS>(scales + r * groups);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      acc[i][r].part[P] = fma_part(
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

// `items` rounded up to a multiple of the pool's threads, at most N (rows to share out).
int64_t even_items(int64_t N, int64_t items) {
  const int64_t threads = pool_threads();
  return std::min(std::max<int64_t>(N, 1), (items + threads - 1) / threads * threads);
}

}  // namespace

bool quantized_kernel_serves(QuantFormat format) {
  return (format.bits == 4 || format.bits == 8) && format.group > 0 && format.group % 32 == 0;
}

bool int8_kernel_serves(QuantFormat format) {
  const int block_weights = format.bits == 4 ? 2 * kBlockBytes : kBlockBytes;
  return quantized_kernel_serves(format) &&
         (block_weights % format.group == 0 || format.group % block_weights == 0);
}

// ANCHOR: qlinear
void quantized_linear_cpu(const float* x, const std::vector<QuantizedPart>& parts, int64_t M,
                          int64_t K, QuantFormat format, bool int8) {
  if (!(int8 ? int8_kernel_serves(format) : quantized_kernel_serves(format)) ||
      K % format.group != 0)
    throw std::invalid_argument("quantized_linear: unsupported format");
  std::optional<StagedRows> rows;
  std::optional<Int8Rows> int8_rows;
  if (int8)
    int8_rows.emplace(x, M, K, format);
  else
    rows.emplace(x, M, K, format);
  const int64_t groups = K / format.group;
  const int64_t row_bytes = K * format.bits / 8;
  const int chunks_per_group = format.group * format.bits / 8 / kBytesPerChunk;
  // A work item: up to 64 rows of x against about 128 KiB of one part's weight rows (their
  // bytes, scales and biases). Larger items stream faster (one run of the prefetchers
  // each; a size tuned against 32 KiB items). So few items need
  // evening out: a part's are of one size, and their number a multiple of the pool's
  // threads (else one thread takes the odd item alone while the others wait: with float16
  // scales the default model's gate and up would come to five items each).
  const int64_t block_rows = 64;
  const int64_t m_blocks = (M + block_rows - 1) / block_rows;
  std::vector<int64_t> first{0}, item_rows;
  int64_t weight_rows = 0;
  for (const auto& part : parts) {
    const int64_t row_cost = row_bytes + 2 * groups * scale_bytes(part.scale_type);
    const int64_t items = even_items(part.N, std::max<int64_t>(1, part.N * row_cost / 131072));
    item_rows.push_back(std::max<int64_t>(1, (part.N + items - 1) / items));  // N may be 0
    first.push_back(first.back() + m_blocks * ((part.N + item_rows.back() - 1) / item_rows.back()));
    weight_rows += part.N;
  }
  if (first.back() == 0) return;  // every part has N = 0
  const double flops = 2.0 * std::min(M, block_rows) * K * weight_rows * m_blocks / first.back();
  parallel_for(static_cast<int>(first.back()), flops, [&](int index) {
    int64_t item = index;
    const size_t p = part_of(first, item);
    const QuantizedPart& part = parts[p];
    const int64_t n0 = item / m_blocks * item_rows[p], mb = item % m_blocks;
    const int64_t m0 = mb * block_rows, m1 = std::min(M, m0 + block_rows);
    const int64_t n1 = std::min(part.N, n0 + item_rows[p]);
    // The item's weight rows from n0: their bytes, scales and biases, and their outputs.
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(part.w) + n0 * row_bytes;
    float* y = part.y + n0;
    with_scales(part, [&](auto scales, auto biases) {
      scales += n0 * groups, biases += n0 * groups;
      if (int8) {
        if (format.bits == 4)
          int8_rows_against_weight_rows<4>(*int8_rows, m0, m1, n1 - n0, bytes, row_bytes, scales,
                                           biases, y, part.N, format.group);
        else
          int8_rows_against_weight_rows<8>(*int8_rows, m0, m1, n1 - n0, bytes, row_bytes, scales,
                                           biases, y, part.N, format.group);
        return;
      }
      for (int64_t n = 0; n < n1 - n0; ++n) {
        const uint8_t* w = bytes + n * row_bytes;
        const auto *s = scales + n * groups, *b = biases + n * groups;
        if (format.bits == 4)
          rows_against_weight_row<4>(*rows, m0, m1, w, s, b, chunks_per_group, y + n, part.N);
        else
          rows_against_weight_row<8>(*rows, m0, m1, w, s, b, chunks_per_group, y + n, part.N);
      }
    });
  });
}
// ANCHOR_END: qlinear

#if defined(__linux__)  // only the OpenBLAS path (Linux) dequantizes whole rows
namespace {

// out[2j] = a[j] and out[2j + 1] = b[j] for the sixteen lanes: 32 floats.
LANES_INLINE void store_interleaved(const F16& a, const F16& b, float* out) {
#if defined(__AVX512F__)
  const FloatPart x = a.part[0], y = b.part[0];
#if defined(__clang__) || __GNUC__ >= 12
  const FloatPart halves[2] = {
      __builtin_shufflevector(x, y, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
      __builtin_shufflevector(x, y, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31)};
#else
  const FloatPart halves[2] = {
      __builtin_shuffle(x, y, IntPart{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}),
      __builtin_shuffle(x, y, IntPart{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15,
                                      31})};
#endif
  std::memcpy(out, halves, sizeof halves);
#elif defined(__AVX2__)
  for (int p = 0; p < 2; ++p) {
    const __m256 low = _mm256_unpacklo_ps(a.part[p], b.part[p]);   // a0 b0 a1 b1 | a4 b4 a5 b5
    const __m256 high = _mm256_unpackhi_ps(a.part[p], b.part[p]);  // a2 b2 a3 b3 | a6 b6 a7 b7
    _mm256_storeu_ps(out + 16 * p, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(out + 16 * p + 8, _mm256_permute2f128_ps(low, high, 0x31));
  }
#else
  for (int j = 0; j < 16; ++j) out[2 * j] = a[j], out[2 * j + 1] = b[j];
#endif
}

// Weight rows n0 .. n1 - 1 of `part` as float32 [n1 - n0, K]: s * q + b (a fused multiply-add,
// one rounding), sixteen weights at a time (a scalar loop is slow enough to show in a
// prefill step: every weight of the layer is dequantized once per step).
template <typename S>
void dequantize_rows(const QuantizedPart& part, const S* scales, const S* biases, int64_t n0,
                     int64_t n1, int64_t K, QuantFormat format, float* out) {
  const int64_t groups = K / format.group, row_bytes = K * format.bits / 8;
  const auto* bytes = reinterpret_cast<const uint8_t*>(part.w);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = bytes + n * row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const F16 s = splat(to_float(scales[n * groups + g]));
      const F16 b = splat(to_float(biases[n * groups + g]));
      for (int64_t k = 0; k < format.group; w += kBytesPerChunk) {
        const I16 q = load_bytes(w);
        if (format.bits == 4) {  // byte j: weights 2j (low nibble) and 2j + 1
          const F16 even = fma16(to_floats(q & 15), s, b);
          const F16 odd = fma16(to_floats(q >> 4), s, b);
          store_interleaved(even, odd, out + k);
          k += 32;
        } else {
          const F16 all = fma16(to_floats(q), s, b);
          std::memcpy(out + k, &all, sizeof all);
          k += 16;
        }
      }
      out += format.group;
    }
  }
}

}  // namespace
#endif

// ANCHOR: qlinear_blas_split
void quantized_linear_blas_split(const float* x, const std::vector<QuantizedPart>& parts,
                                 int64_t M, int64_t K, QuantFormat format) {
#if defined(__linux__)
  if (!quantized_kernel_serves(format) || K % format.group != 0)
    throw std::invalid_argument("quantized_linear: unsupported format");
  // Blocks of 64 weight rows: their float32 copy (64 K floats) stays in L2 for the product.
  constexpr int64_t block = 64;
  std::vector<int64_t> first{0};
  for (const auto& part : parts) first.push_back(first.back() + (part.N + block - 1) / block);
  if (first.back() == 0) return;
  parallel_for(static_cast<int>(first.back()), 2.0 * M * K * block, [&](int index) {
    int64_t b = index;
    const QuantizedPart& part = parts[part_of(first, b)];
    const int64_t n0 = b * block, n = std::min(part.N, n0 + block) - n0;
    thread_local std::vector<float> weights;
    weights.resize(n * K);
    with_scales(part, [&](auto scales, auto biases) {
      dequantize_rows(part, scales, biases, n0, n0 + n, K, format, weights.data());
    });
    cblas_sgemm(101, 111, 112, static_cast<int>(M), static_cast<int>(n), static_cast<int>(K),
                1.0f, x, static_cast<int>(K), weights.data(), static_cast<int>(K), 0.0f,
                part.y + n0, static_cast<int>(part.N));
  });
#else
  (void)x, (void)parts, (void)M, (void)K, (void)format;
  throw std::runtime_error("quantized_linear(blas=True): Linux only");
#endif
}
// ANCHOR_END: qlinear_blas_split

}  // namespace tiny_llm
