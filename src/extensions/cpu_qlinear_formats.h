// The stored formats of the quantized kernels' scales and biases (float32, float16,
// bfloat16), widened to float32 lanes where they are read.
// Private to cpu_qlinear.cpp, which includes it once: its definitions live in an
// anonymous namespace.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_qlinear.h"
#include "cpu_qlinear_lanes.h"

namespace tiny_llm {
namespace {

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
SIMD_INLINE F16 load_floats(const S* p, int count) {
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
SIMD_INLINE __m128 first_values(const S* p) {
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

}  // namespace
}  // namespace tiny_llm
