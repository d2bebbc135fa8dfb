// The CPU kernels' one vector vocabulary. Every kernel (attention, the float32 and the
// quantized linear layers) holds its lanes in these types and combines them with these
// operations, each written here once per instruction set: AVX-512, AVX2 with FMA, and plain
// C++ that other CPUs (a Mac's NEON) compile. Each operation is defined lane by lane, or in a
// fixed order where it combines lanes, so that a kernel's bits do not depend on which of them
// computes it (tests/test_cpu_kernels.py builds every kernel for each and compares).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace tiny_llm {
namespace simd {

// Inlined always: a call would pass the lanes through memory.
#define SIMD_INLINE inline __attribute__((always_inline))

// ANCHOR: simd_types
// Eight floats as one value (GCC's and Clang's vector extension): arithmetic on it runs lane
// by lane, in one vector register where the CPU has 256-bit ones, in two NEON or SSE ones
// elsewhere.
typedef float Lanes8 __attribute__((vector_size(32)));
typedef int32_t Ints8 __attribute__((vector_size(32)));

// The target's own register of floats (or int32s): sixteen lanes with AVX-512, eight with
// AVX2, four elsewhere. A kernel that needs more lanes than one register holds (the quantized
// kernel's sixteen) keeps an array of parts rather than one wider vector value: GCC keeps a
// vector wider than the target's registers on the stack and calls a function for each
// multiply-add on it.
#if defined(__AVX512F__)
constexpr int kPartLanes = 16;
#elif defined(__AVX2__)
constexpr int kPartLanes = 8;
#else
constexpr int kPartLanes = 4;
#endif
typedef float FloatPart __attribute__((vector_size(4 * kPartLanes)));
typedef int32_t IntPart __attribute__((vector_size(4 * kPartLanes)));
// ANCHOR_END: simd_types

// ANCHOR: simd_fma
// a * b + c rounded once, lane by lane, on every target. Spelled out because `c + a * b`
// leaves the fusing to the compiler, whose choice depends on the CPU it tunes for (on a
// Zen 3, -march=native fused fewer than -mavx2 -mfma, and the two builds' bits differed).
// Where the target has no fused instruction for the width, std::fma rounds once all the same
// (a NEON compiler emits its fused instruction for it; an x86 CPU without FMA calls libm).
template <class V>
SIMD_INLINE V fma(V a, V b, V c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return _mm512_fmadd_ps(a, b, c);
#endif
#if defined(__FMA__)
  if constexpr (sizeof(V) == 32) return _mm256_fmadd_ps(a, b, c);
  if constexpr (sizeof(V) == 16) return _mm_fmadd_ps(a, b, c);
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
  if constexpr (sizeof(V) == 16) return (V)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#endif
  for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(float)); ++i)
    c[i] = std::fma(a[i], b[i], c[i]);
  return c;
}

SIMD_INLINE float fma(float a, float b, float c) { return std::fma(a, b, c); }
// ANCHOR_END: simd_fma

// v in every lane (exact, -0.0 included: -0.0 - +0.0 is -0.0).
template <class V>
SIMD_INLINE V splat(float v) {
  return v - V{};
}

SIMD_INLINE Lanes8 load8(const float* p) {
  Lanes8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Lanes lo .. hi - 1 of the eight at p, the others zero; nothing outside them is read (the
// first and last vectors of a row can be partial).
SIMD_INLINE Lanes8 load8(const float* p, int lo, int hi) {
#if defined(__AVX2__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(lo - 1)),
                                      _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane));
  return _mm256_maskload_ps(p, in);
#else
  Lanes8 out{};
  for (int i = lo; i < hi; ++i) out[i] = p[i];
  return out;
#endif
}

// The value itself, made to live in a register: GCC otherwise folds a load into every
// multiply-add that uses the value (a vfmadd with a memory operand), and the loads, not the
// multiply-adds, then set the pace. It costs no instruction and changes no bit.
SIMD_INLINE Lanes8 in_register(Lanes8 a) {
#if defined(__AVX512VL__)
  asm("" : "+v"(a));  // any of the 32 vector registers
#elif defined(__AVX__)
  asm("" : "+x"(a));
#endif
  return a;
}

// Lanes I... of the sixteen lanes of x then y.
template <int... I>
SIMD_INLINE Lanes8 pick(Lanes8 x, Lanes8 y) {
#if defined(__clang__) || __GNUC__ >= 12
  return __builtin_shufflevector(x, y, I...);
#else
  return __builtin_shuffle(x, y, Ints8{I...});
#endif
}

// Lane j of the result is lane (j - rotation) mod 8 of v.
SIMD_INLINE Lanes8 rotate(Lanes8 v, int rotation) {
#if defined(__AVX2__)
  const __m256i from = _mm256_and_si256(
      _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 - rotation)),
      _mm256_set1_epi32(7));
  return _mm256_permutevar8x32_ps(v, from);
#else
  Lanes8 out;
  for (int i = 0; i < 8; ++i) out[i] = v[(i + 8 - rotation) % 8];
  return out;
#endif
}

// ANCHOR: simd_exp8
// exp of eight lanes at once (Cephes' single-precision polynomial, within about 2 ulp of
// std::exp), where a loop of std::exp calls runs one lane at a time: x = n ln 2 + r with
// |r| <= ln 2 / 2, exp(r) by a polynomial, times 2^n built in the exponent bits. Below -87
// the lanes give about 1e-38 where std::exp underflows to 0, and above 88 about 1.7e38
// where it overflows: nothing a softmax or SwiGLU's x / (1 + exp(-x)) can see.
SIMD_INLINE Lanes8 exp8(Lanes8 x) {
  const Lanes8 lo = Lanes8{} - 87.0f, hi = Lanes8{} + 88.0f;
  x = x < lo ? lo : (x > hi ? hi : x);
  const Lanes8 shift = Lanes8{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Lanes8 n = (x * 1.44269504088896341f + shift) - shift;
  const Lanes8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Lanes8 p = Lanes8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const Ints8 bits = (__builtin_convertvector(n, Ints8) + 127) << 23;
  Lanes8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
// ANCHOR_END: simd_exp8

// ANCHOR: simd_sum
// The eight lanes added in one fixed tree, ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)):
// lane j + 4 onto lane j, then j + 2, then j + 1.
SIMD_INLINE float sum_tree(Lanes8 v) {
#if defined(__AVX__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
#endif
}

// sum_tree of eight vectors at once (a[0..3], then b[0..3]); lane i is vector i's sum.
// The same additions of the same lanes, done across the vectors: seven vector additions of
// shuffled lanes, where eight sum_trees make 56 additions of single lanes.
SIMD_INLINE Lanes8 sum_trees8(const Lanes8* a, const Lanes8* b) {
  auto halves = [](Lanes8 x, Lanes8 y) {  // lane j + lane j + 4, of x then of y
    return pick<0, 1, 2, 3, 8, 9, 10, 11>(x, y) + pick<4, 5, 6, 7, 12, 13, 14, 15>(x, y);
  };
  auto quarters = [](Lanes8 x, Lanes8 y) {  // then (0+4)+(2+6) and (1+5)+(3+7) of each
    return pick<0, 1, 4, 5, 8, 9, 12, 13>(x, y) + pick<2, 3, 6, 7, 10, 11, 14, 15>(x, y);
  };
  const Lanes8 x = quarters(halves(a[0], a[1]), halves(a[2], a[3]));
  const Lanes8 y = quarters(halves(b[0], b[1]), halves(b[2], b[3]));
  return pick<0, 2, 4, 6, 8, 10, 12, 14>(x, y) + pick<1, 3, 5, 7, 9, 11, 13, 15>(x, y);
}
// ANCHOR_END: simd_sum

}  // namespace simd
}  // namespace tiny_llm
