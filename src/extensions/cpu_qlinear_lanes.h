// The quantized kernels' sixteen lanes, made of the target's registers (cpu_simd.h): their
// arithmetic in a fixed order, and the loads (AVX-512, AVX2, or plain C++).
// Private to cpu_qlinear.cpp, which includes it once: its definitions live in an
// anonymous namespace.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_simd.h"

namespace tiny_llm {
namespace {

using namespace simd;  // FloatPart, IntPart and their operations (cpu_simd.h)

// ANCHOR: qlinear_lanes
// Sixteen float (or int32) lanes, held in the target's own vector registers (FloatPart):
// one AVX-512 register, two AVX2 ones, four NEON or SSE ones. Held as one 64-byte GCC vector
// instead, a target without 64-byte registers kept every value on the stack and called a
// function for each multiply-add: on AVX2 the kernel read its weights many times slower
// than the float32 kernel does (the book's performance appendix). The arithmetic below is
// lane by lane (and what combines lanes, sum_lanes and the integer products, does so in a
// fixed order), so the bits are the same whatever holds the lanes.
constexpr int kParts = 16 / kPartLanes;
typedef uint8_t U8x16 __attribute__((vector_size(16)));

// Sixteen packed bytes widen to sixteen int32 lanes (I16): 32 weights at 4 bits (byte j
// holds weights 2j and 2j + 1 of its 32), 16 at 8 bits; F16 holds sixteen floats.
struct F16 {
  FloatPart part[kParts];
  SIMD_INLINE float operator[](int i) const { return part[i / kPartLanes][i % kPartLanes]; }
  SIMD_INLINE void set(int i, float v) { part[i / kPartLanes][i % kPartLanes] = v; }
};

struct I16 {
  IntPart part[kParts];
  SIMD_INLINE int32_t operator[](int i) const { return part[i / kPartLanes][i % kPartLanes]; }
  SIMD_INLINE void set(int i, int32_t v) { part[i / kPartLanes][i % kPartLanes] = v; }
};
// ANCHOR_END: qlinear_lanes

SIMD_INLINE F16 operator+(F16 a, const F16& b) {
  for (int p = 0; p < kParts; ++p) a.part[p] += b.part[p];
  return a;
}
SIMD_INLINE F16& operator+=(F16& a, const F16& b) { return a = a + b; }
SIMD_INLINE I16 operator&(I16 a, int32_t mask) {
  for (int p = 0; p < kParts; ++p) a.part[p] &= mask;
  return a;
}
SIMD_INLINE I16 operator>>(I16 a, int shift) {
  for (int p = 0; p < kParts; ++p) a.part[p] >>= shift;
  return a;
}
SIMD_INLINE F16 to_floats(const I16& q) {
  F16 out;
  for (int p = 0; p < kParts; ++p) out.part[p] = __builtin_convertvector(q.part[p], FloatPart);
  return out;
}

SIMD_INLINE F16 fma16(const F16& a, const F16& b, F16 c) {
  for (int p = 0; p < kParts; ++p) c.part[p] = fma(a.part[p], b.part[p], c.part[p]);
  return c;
}

SIMD_INLINE F16 splat(float v) {
  F16 out;
  for (int p = 0; p < kParts; ++p) out.part[p] = simd::splat<FloatPart>(v);
  return out;
}

// The sixteen lanes summed in a fixed tree: lane i + 8 onto lane i, then sum_tree's.
SIMD_INLINE float sum_lanes(const F16& v) {
  Lanes8 half[2];
  std::memcpy(half, &v, sizeof half);
  return sum_tree(half[0] + half[1]);
}

// The first `count` (1 .. 16) floats at p, the other lanes zero; nothing past them is read.
SIMD_INLINE F16 load_floats(const float* p, int count) {
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
SIMD_INLINE I16 load_bytes(const uint8_t* p) {
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

}  // namespace
}  // namespace tiny_llm
