// The quantized kernels' sixteen lanes, per instruction set: the vector types, their
// arithmetic in a fixed order, and the loads (AVX-512, AVX2, NEON, or plain C++).
// Private to cpu_qlinear.cpp, which includes it once: its definitions live in an
// anonymous namespace.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

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

}  // namespace
}  // namespace tiny_llm
