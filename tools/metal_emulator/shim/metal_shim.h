// Metal Shading Language shim: lets a .metal file in the project's MSL subset
// compile unchanged as C++17 (g++ >= 12) and run under the emulator runtime.
//
// Idea: everything MSL adds to C++ is either a type/function (defined here),
// an address-space keyword (defined away), or an attribute. Tokens inside
// `[[...]]` are macro-expanded, so an attribute macro such as `buffer(n)` can
// close the attribute and open a default argument:
//     device float* out [[buffer(0)]]
//  -> device float* out [[]] = ::mtl_emu::buffer_arg[(0) + ::mtl_emu::zero[0]]
// and the kernel becomes callable with no arguments; each call (one per
// simulated GPU thread) binds the buffers the host set, by index, and reads
// the running thread's position. Threadgroup variables cannot be expressed by
// a header; the harness's pre-pass rewrites them (see harness/source.py).
//
// The kernel translation unit must not include <cmath>/<cstdlib>: their global
// overloads make unqualified MSL math calls ambiguous. Math goes through
// __builtin_*.
#pragma once

#include <float.h>
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "emu_abi.h"

// ------------------------------------------------------------ scalar types

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef _Float16 float16_t;  // MLX's name for half (its JIT signatures use it)

namespace metal {

// bfloat16: storage plus float conversion; float -> bfloat rounds to nearest
// even (NaN stays a quiet NaN). Arithmetic between bfloats rounds back to
// bfloat; mixed arithmetic yields float.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) : bits(from_float(f)) {}  // NOLINT: implicit like MSL
  template <class S, std::enable_if_t<std::is_arithmetic_v<S> || std::is_same_v<S, _Float16>, int> = 0>
  bfloat(S s) : bits(from_float(static_cast<float>(s))) {}
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t from_float(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};
typedef bfloat bfloat16_t;

}  // namespace metal

namespace mtl_emu {
template <class T> struct is_scalar : std::bool_constant<std::is_arithmetic_v<T>> {};
template <> struct is_scalar<_Float16> : std::true_type {};
template <> struct is_scalar<metal::bfloat> : std::true_type {};
template <class T> constexpr bool is_scalar_v = is_scalar<std::remove_cv_t<T>>::value;
template <class T> constexpr bool is_float_v =
    std::is_floating_point_v<T> || std::is_same_v<T, _Float16> || std::is_same_v<T, metal::bfloat>;

// "Params" for T = Params, for error reports.
template <class T> const char* type_name() {
  static char buf[128];
  if (!buf[0]) {
    const char* p = __PRETTY_FUNCTION__;
    const char* s = __builtin_strstr(p, "T = ");
    s = s ? s + 4 : p;
    size_t n = 0;
    while (s[n] && s[n] != ';' && s[n] != ']' && n + 1 < sizeof buf) {
      buf[n] = s[n];
      n++;
    }
    buf[n] = 0;
  }
  return buf;
}
}  // namespace mtl_emu

namespace metal {

#define MTL_EMU_BF_OPS(op)                                                                   \
  inline bfloat operator op(bfloat a, bfloat b) {                                          \
    return bfloat(static_cast<float>(a) op static_cast<float>(b));                         \
  }                                                                                        \
  template <class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>                   \
  inline auto operator op(bfloat a, S b) { return static_cast<float>(a) op b; }            \
  template <class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>                   \
  inline auto operator op(S a, bfloat b) { return a op static_cast<float>(b); }            \
  template <class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>                   \
  inline bfloat& operator op##=(bfloat& a, S b) {                                          \
    a = bfloat(static_cast<float>(a) op static_cast<float>(b));                            \
    return a;                                                                              \
  }
MTL_EMU_BF_OPS(+)
MTL_EMU_BF_OPS(-)
MTL_EMU_BF_OPS(*)
MTL_EMU_BF_OPS(/)
#undef MTL_EMU_BF_OPS
inline bfloat operator-(bfloat a) {
  a.bits ^= 0x8000u;
  return a;
}
#define MTL_EMU_BF_CMP(op)                                                                   \
  inline bool operator op(bfloat a, bfloat b) { return static_cast<float>(a) op static_cast<float>(b); } \
  template <class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>                   \
  inline bool operator op(bfloat a, S b) { return static_cast<float>(a) op b; }            \
  template <class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>                   \
  inline bool operator op(S a, bfloat b) { return a op static_cast<float>(b); }
MTL_EMU_BF_CMP(<)
MTL_EMU_BF_CMP(>)
MTL_EMU_BF_CMP(<=)
MTL_EMU_BF_CMP(>=)
MTL_EMU_BF_CMP(==)
MTL_EMU_BF_CMP(!=)
#undef MTL_EMU_BF_CMP

// ------------------------------------------------------------------ vectors
// vec<T,N>: N in 2..4 with members x, y, z, w; size and alignment as in MSL
// (a 3-vector occupies 4 elements). Constructors: broadcast from a scalar,
// one scalar per component, (vec2, vec2), (vec3, s), (vec2, s, s), and
// explicit conversion from another element type. No swizzles.

template <class T, int N> struct vec_storage;
template <class T> struct alignas(2 * sizeof(T)) vec_storage<T, 2> { T x, y; };
template <class T> struct alignas(4 * sizeof(T)) vec_storage<T, 3> { T x, y, z; };
template <class T> struct alignas(4 * sizeof(T)) vec_storage<T, 4> { T x, y, z, w; };

template <class T, int N> struct vec : vec_storage<T, N> {
  vec() = default;
  template <class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>
  vec(S s) {  // NOLINT: implicit scalar broadcast, as in MSL
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(s);
  }
  template <class... S, std::enable_if_t<sizeof...(S) == N && N >= 2 && (mtl_emu::is_scalar_v<S> && ...), int> = 0>
  vec(S... s) {
    T v[N] = {static_cast<T>(s)...};
    for (int i = 0; i < N; ++i) (*this)[i] = v[i];
  }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(const vec<T, 2>& a, const vec<T, 2>& b) {
    (*this)[0] = a[0]; (*this)[1] = a[1]; (*this)[2] = b[0]; (*this)[3] = b[1];
  }
  template <class S, int M = N, std::enable_if_t<M == 4 && mtl_emu::is_scalar_v<S>, int> = 0>
  vec(const vec<T, 3>& a, S s) {
    (*this)[0] = a[0]; (*this)[1] = a[1]; (*this)[2] = a[2]; (*this)[3] = static_cast<T>(s);
  }
  template <class S1, class S2, int M = N,
            std::enable_if_t<M == 4 && mtl_emu::is_scalar_v<S1> && mtl_emu::is_scalar_v<S2>, int> = 0>
  vec(const vec<T, 2>& a, S1 s, S2 t) {
    (*this)[0] = a[0]; (*this)[1] = a[1]; (*this)[2] = static_cast<T>(s); (*this)[3] = static_cast<T>(t);
  }
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);
  }
  T& operator[](int i) { return reinterpret_cast<T*>(this)[i]; }
  const T& operator[](int i) const { return reinterpret_cast<const T*>(this)[i]; }

#define MTL_EMU_VEC_ASSIGN(op)                                                          \
  vec& operator op##=(const vec& o) {                                                 \
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>((*this)[i] op o[i]);      \
    return *this;                                                                     \
  }                                                                                   \
  template <class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>              \
  vec& operator op##=(S s) {                                                          \
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>((*this)[i] op static_cast<T>(s)); \
    return *this;                                                                     \
  }
  MTL_EMU_VEC_ASSIGN(+)
  MTL_EMU_VEC_ASSIGN(-)
  MTL_EMU_VEC_ASSIGN(*)
  MTL_EMU_VEC_ASSIGN(/)
#undef MTL_EMU_VEC_ASSIGN
};

#define MTL_EMU_VEC_BINOP(op)                                                               \
  template <class T, int N>                                                               \
  vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                         \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op b[i]);                      \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>  \
  vec<T, N> operator op(const vec<T, N>& a, S s) {                                        \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op static_cast<T>(s));        \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, class S, std::enable_if_t<mtl_emu::is_scalar_v<S>, int> = 0>  \
  vec<T, N> operator op(S s, const vec<T, N>& a) {                                        \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(static_cast<T>(s) op a[i]);        \
    return r;                                                                             \
  }
MTL_EMU_VEC_BINOP(+)
MTL_EMU_VEC_BINOP(-)
MTL_EMU_VEC_BINOP(*)
MTL_EMU_VEC_BINOP(/)
#undef MTL_EMU_VEC_BINOP
template <class T, int N> vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(-a[i]);
  return r;
}

#define MTL_EMU_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;       \
  typedef vec<T, 3> name##3;       \
  typedef vec<T, 4> name##4;
MTL_EMU_VEC_TYPES(float, float)
MTL_EMU_VEC_TYPES(half, half)
MTL_EMU_VEC_TYPES(bfloat, bfloat)
MTL_EMU_VEC_TYPES(int, int)
MTL_EMU_VEC_TYPES(uint, uint)
MTL_EMU_VEC_TYPES(short, short)
MTL_EMU_VEC_TYPES(ushort, ushort)
MTL_EMU_VEC_TYPES(char, char)
MTL_EMU_VEC_TYPES(uchar, uchar)
MTL_EMU_VEC_TYPES(long, long)
MTL_EMU_VEC_TYPES(ulong, ulong)
MTL_EMU_VEC_TYPES(bool, bool)
#undef MTL_EMU_VEC_TYPES

// --------------------------------------------------------------------- math
// Computed in float (IEEE, not fast-math), rounded to the argument's type.

#define MTL_EMU_UNARY(name, expr)                                                     \
  inline float name(float x) { return expr; }                                       \
  inline half name(half hx) {                                                       \
    float x = static_cast<float>(hx);                                               \
    return static_cast<half>(expr);                                                 \
  }                                                                                 \
  inline bfloat name(bfloat bx) {                                                   \
    float x = static_cast<float>(bx);                                               \
    return bfloat(expr);                                                            \
  }                                                                                 \
  template <class T, int N> vec<T, N> name(vec<T, N> v) {                           \
    for (int i = 0; i < N; ++i) v[i] = name(v[i]);                                  \
    return v;                                                                       \
  }
MTL_EMU_UNARY(exp, __builtin_expf(x))
MTL_EMU_UNARY(exp2, __builtin_exp2f(x))
MTL_EMU_UNARY(log, __builtin_logf(x))
MTL_EMU_UNARY(log2, __builtin_log2f(x))
MTL_EMU_UNARY(sqrt, __builtin_sqrtf(x))
MTL_EMU_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
MTL_EMU_UNARY(fabs, __builtin_fabsf(x))
MTL_EMU_UNARY(floor, __builtin_floorf(x))
MTL_EMU_UNARY(ceil, __builtin_ceilf(x))
MTL_EMU_UNARY(round, __builtin_roundf(x))
MTL_EMU_UNARY(rint, __builtin_rintf(x))
MTL_EMU_UNARY(trunc, __builtin_truncf(x))
MTL_EMU_UNARY(sin, __builtin_sinf(x))
MTL_EMU_UNARY(cos, __builtin_cosf(x))
MTL_EMU_UNARY(tanh, __builtin_tanhf(x))
MTL_EMU_UNARY(erf, __builtin_erff(x))
MTL_EMU_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
#undef MTL_EMU_UNARY

template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T abs(T x) {
  if constexpr (mtl_emu::is_float_v<T>) {
    return static_cast<T>(__builtin_fabsf(static_cast<float>(x)));
  } else {
    return x < 0 ? static_cast<T>(-x) : x;
  }
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T max(T a, T b) {
  if constexpr (mtl_emu::is_float_v<T>) {
    return static_cast<T>(__builtin_fmaxf(static_cast<float>(a), static_cast<float>(b)));
  } else {
    return a > b ? a : b;
  }
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T min(T a, T b) {
  if constexpr (mtl_emu::is_float_v<T>) {
    return static_cast<T>(__builtin_fminf(static_cast<float>(a), static_cast<float>(b)));
  } else {
    return a < b ? a : b;
  }
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T fmax(T a, T b) { return max(a, b); }
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T fmin(T a, T b) { return min(a, b); }
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T pow(T a, T b) {
  return static_cast<T>(__builtin_powf(static_cast<float>(a), static_cast<float>(b)));
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T fma(T a, T b, T c) {
  return static_cast<T>(__builtin_fmaf(static_cast<float>(a), static_cast<float>(b), static_cast<float>(c)));
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> bool isnan(T x) {
  return __builtin_isnan(static_cast<float>(x));
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> bool isinf(T x) {
  return __builtin_isinf(static_cast<float>(x));
}
template <class T, std::enable_if_t<mtl_emu::is_scalar_v<T>, int> = 0> bool isfinite(T x) {
  return __builtin_isfinite(static_cast<float>(x));
}
template <class T, int N> vec<T, N> abs(vec<T, N> v) {
  for (int i = 0; i < N; ++i) v[i] = abs(v[i]);
  return v;
}
template <class T, int N> vec<T, N> max(vec<T, N> a, const vec<T, N>& b) {
  for (int i = 0; i < N; ++i) a[i] = max(a[i], b[i]);
  return a;
}
template <class T, int N> vec<T, N> min(vec<T, N> a, const vec<T, N>& b) {
  for (int i = 0; i < N; ++i) a[i] = min(a[i], b[i]);
  return a;
}
template <class T, int N> T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = static_cast<T>(a[0] * b[0]);
  for (int i = 1; i < N; ++i) s = static_cast<T>(s + a[i] * b[i]);
  return s;
}

template <class To, class From> To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To r;
  __builtin_memcpy(&r, &x, sizeof(To));
  return r;
}

template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float max() { return FLT_MAX; }
  static constexpr float lowest() { return -FLT_MAX; }
  static constexpr float min() { return FLT_MIN; }
  static constexpr float epsilon() { return FLT_EPSILON; }
  static constexpr float infinity() { return __builtin_inff(); }
};
template <> struct numeric_limits<half> {
  static constexpr half max() { return static_cast<half>(65504.0f); }
  static constexpr half lowest() { return static_cast<half>(-65504.0f); }
  static constexpr half infinity() { return static_cast<half>(__builtin_inff()); }
};
template <> struct numeric_limits<int> {
  static constexpr int max() { return 0x7fffffff; }
  static constexpr int min() { return -0x7fffffff - 1; }
  static constexpr int lowest() { return -0x7fffffff - 1; }
};
template <> struct numeric_limits<uint> {
  static constexpr uint max() { return 0xffffffffu; }
  static constexpr uint min() { return 0u; }
  static constexpr uint lowest() { return 0u; }
};

namespace fast {
using metal::abs; using metal::ceil; using metal::clamp; using metal::cos; using metal::exp;
using metal::exp2; using metal::fabs; using metal::floor; using metal::fmax; using metal::fmin;
using metal::log; using metal::log2; using metal::max; using metal::min; using metal::pow;
using metal::rsqrt; using metal::sin; using metal::sqrt; using metal::tanh; using metal::trunc;
}  // namespace fast
namespace precise {
using metal::abs; using metal::ceil; using metal::clamp; using metal::cos; using metal::exp;
using metal::exp2; using metal::fabs; using metal::floor; using metal::fmax; using metal::fmin;
using metal::log; using metal::log2; using metal::max; using metal::min; using metal::pow;
using metal::rsqrt; using metal::sin; using metal::sqrt; using metal::tanh; using metal::trunc;
}  // namespace precise

// --------------------------------------------------------------- barriers

enum class mem_flags : int {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
};
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}

// A switch point: every live thread of the threadgroup must arrive here.
inline void threadgroup_barrier(mem_flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  mtl_emu::threadgroup_barrier(file, line);
}
// A switch point among the lanes of one simdgroup (lanes reading other lanes'
// threadgroup writes need it).
inline void simdgroup_barrier(mem_flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  mtl_emu::collective(nullptr, nullptr, 0, nullptr, "simdgroup_barrier", file, line);
}

}  // namespace metal

// -------------------------------------------------------- simd collectives

namespace mtl_emu {

struct AddOp {
  template <class T> T operator()(const T& a, const T& b) const { return static_cast<T>(a + b); }
};
struct MulOp {
  template <class T> T operator()(const T& a, const T& b) const { return static_cast<T>(a * b); }
};
struct MaxOp {
  template <class T> T operator()(const T& a, const T& b) const { return metal::max(a, b); }
};
struct MinOp {
  template <class T> T operator()(const T& a, const T& b) const { return metal::min(a, b); }
};
struct AndOp {
  bool operator()(bool a, bool b) const { return a && b; }
};
struct OrOp {
  bool operator()(bool a, bool b) const { return a || b; }
};

template <class T> inline const T& lane_in(const CollectiveView& v, int i) {
  return *static_cast<const T*>(v.in[i]);
}
template <class T> inline T& lane_out(const CollectiveView& v, int i) { return *static_cast<T*>(v.out[i]); }
inline bool takes_part(const CollectiveView& v, int i) { return (v.mask >> i) & 1u; }

// Reduction over the taking-part lanes in increasing lane order; every lane
// gets the same result.
template <class T, class Op> void reduce_combine(const CollectiveView& v) {
  T acc{};
  bool have = false;
  for (int i = 0; i < v.n; ++i) {
    if (!takes_part(v, i)) continue;
    acc = have ? Op()(acc, lane_in<T>(v, i)) : lane_in<T>(v, i);
    have = true;
  }
  for (int i = 0; i < v.n; ++i) {
    if (takes_part(v, i)) lane_out<T>(v, i) = acc;
  }
}

template <class T, bool Inclusive> void prefix_combine(const CollectiveView& v) {
  T acc = static_cast<T>(0);
  for (int i = 0; i < v.n; ++i) {
    if (!takes_part(v, i)) continue;
    if (Inclusive) acc = static_cast<T>(acc + lane_in<T>(v, i));
    lane_out<T>(v, i) = acc;
    if (!Inclusive) acc = static_cast<T>(acc + lane_in<T>(v, i));
  }
}

enum ShuffleMode { kShuffleIndex, kShuffleDown, kShuffleUp, kShuffleXor, kBroadcast, kBroadcastFirst };

// Lane i receives the payload of a source lane; a source that does not take
// part yields poison bytes (0xFF: NaN for floats).
template <class T, int Mode> void shuffle_combine(const CollectiveView& v) {
  int first = -1;
  for (int i = 0; i < v.n && first < 0; ++i) {
    if (takes_part(v, i)) first = i;
  }
  for (int i = 0; i < v.n; ++i) {
    if (!takes_part(v, i)) continue;
    int a = v.arg[i];
    int src = i;
    switch (Mode) {
      case kShuffleIndex: src = a; break;
      case kShuffleDown: src = i + a < v.n ? i + a : i; break;
      case kShuffleUp: src = i - a >= 0 ? i - a : i; break;
      case kShuffleXor: src = (i ^ a) < v.n ? (i ^ a) : i; break;
      case kBroadcast:
        if (a != v.arg[first]) {
          fail(kErrSimd, "simd_broadcast: lanes pass different source lanes (the lane must be "
                         "simdgroup-uniform)");
        }
        src = a;
        break;
      case kBroadcastFirst: src = first; break;
    }
    if (src >= 0 && src < v.n && takes_part(v, src)) {
      lane_out<T>(v, i) = lane_in<T>(v, src);
    } else {
      __builtin_memset(&lane_out<T>(v, i), 0xFF, sizeof(T));
    }
  }
}

template <class T, class Fn> inline T run_collective(const T& x, int arg, Fn fn, const char* kind,
                                                     const char* file, int line) {
  T in = x;
  T out;
  collective(&in, &out, arg, fn, kind, file, line);
  return out;
}

}  // namespace mtl_emu

namespace metal {

#define MTL_EMU_LOC const char *file = __builtin_FILE(), int line = __builtin_LINE()
template <class T> T simd_sum(T x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::reduce_combine<T, mtl_emu::AddOp>, "simd_sum", file, line);
}
template <class T> T simd_product(T x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::reduce_combine<T, mtl_emu::MulOp>, "simd_product", file, line);
}
template <class T> T simd_max(T x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::reduce_combine<T, mtl_emu::MaxOp>, "simd_max", file, line);
}
template <class T> T simd_min(T x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::reduce_combine<T, mtl_emu::MinOp>, "simd_min", file, line);
}
inline bool simd_all(bool x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::reduce_combine<bool, mtl_emu::AndOp>, "simd_all", file, line);
}
inline bool simd_any(bool x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::reduce_combine<bool, mtl_emu::OrOp>, "simd_any", file, line);
}
template <class T> T simd_prefix_exclusive_sum(T x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::prefix_combine<T, false>, "simd_prefix_exclusive_sum", file, line);
}
template <class T> T simd_prefix_inclusive_sum(T x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::prefix_combine<T, true>, "simd_prefix_inclusive_sum", file, line);
}
template <class T> T simd_shuffle(T x, ushort lane, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, lane, &mtl_emu::shuffle_combine<T, mtl_emu::kShuffleIndex>, "simd_shuffle", file, line);
}
template <class T> T simd_shuffle_down(T x, ushort delta, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, delta, &mtl_emu::shuffle_combine<T, mtl_emu::kShuffleDown>, "simd_shuffle_down", file, line);
}
template <class T> T simd_shuffle_up(T x, ushort delta, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, delta, &mtl_emu::shuffle_combine<T, mtl_emu::kShuffleUp>, "simd_shuffle_up", file, line);
}
template <class T> T simd_shuffle_xor(T x, ushort mask, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, mask, &mtl_emu::shuffle_combine<T, mtl_emu::kShuffleXor>, "simd_shuffle_xor", file, line);
}
template <class T> T simd_broadcast(T x, ushort lane, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, lane, &mtl_emu::shuffle_combine<T, mtl_emu::kBroadcast>, "simd_broadcast", file, line);
}
template <class T> T simd_broadcast_first(T x, MTL_EMU_LOC) {
  return mtl_emu::run_collective(x, 0, &mtl_emu::shuffle_combine<T, mtl_emu::kBroadcastFirst>, "simd_broadcast_first", file, line);
}

// ------------------------------------------------------ simdgroup_matrix
// 8x8 matrices, two elements per lane. Lane l holds row r, columns c and c+1:
//   r = 4*bit4(l) + 2*bit2(l) + bit1(l),  c = 4*bit3(l) + 2*bit0(l)
// (the layout Apple GPUs use and MLX's GEMM code relies on through
// thread_elements()). Loads and stores are lane-local; multiplies are
// collectives computed in float with a fixed k order.

inline void simdgroup_lane_coord(uint lane, int& row, int& col) {
  row = static_cast<int>(((lane >> 4) & 1u) * 4 + ((lane >> 1) & 3u));
  col = static_cast<int>(((lane >> 3) & 1u) * 4 + (lane & 1u) * 2);
}

template <class T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup matrices only");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  // MSL: a diagonal matrix with `d` on the diagonal.
  explicit simdgroup_matrix(T d) {
    int r, c;
    simdgroup_lane_coord(mtl_emu::tl_thread->lane, r, c);
    e[0] = r == c ? d : static_cast<T>(0);
    e[1] = r == c + 1 ? d : static_cast<T>(0);
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int C, int R> simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, C, R> m;
  m.e[0] = value;
  m.e[1] = value;
  return m;
}

// Element (r, c) of the matrix is base[r * elements_per_row + c] (or
// base[c * elements_per_row + r] when transposed), base = src + origin.y *
// elements_per_row + origin.x.
template <class T, class U>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const U* src, ulong elements_per_row = 8,
                    ulong2 origin = ulong2(0), bool transpose = false) {
  int r, c;
  simdgroup_lane_coord(mtl_emu::tl_thread->lane, r, c);
  const U* base = src + origin.y * elements_per_row + origin.x;
  for (int k = 0; k < 2; ++k) {
    ulong i = transpose ? static_cast<ulong>(c + k) * elements_per_row + r
                        : static_cast<ulong>(r) * elements_per_row + static_cast<ulong>(c + k);
    d.e[k] = static_cast<T>(base[i]);
  }
}

template <class T, class U>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, U* dst, ulong elements_per_row = 8,
                     ulong2 origin = ulong2(0), bool transpose = false) {
  int r, c;
  simdgroup_lane_coord(mtl_emu::tl_thread->lane, r, c);
  U* base = dst + origin.y * elements_per_row + origin.x;
  for (int k = 0; k < 2; ++k) {
    ulong i = transpose ? static_cast<ulong>(c + k) * elements_per_row + r
                        : static_cast<ulong>(r) * elements_per_row + static_cast<ulong>(c + k);
    base[i] = static_cast<U>(m.e[k]);
  }
}

}  // namespace metal

namespace mtl_emu {
// Payload: a, b, c (two floats each); result: d (two floats).
inline void mma_combine(const CollectiveView& v) {
  if (v.n != 32 || v.mask != 0xFFFFFFFFu) {
    fail(kErrSimd, "simdgroup_matrix multiply needs a full simdgroup of 32 live lanes");
  }
  float A[8][8], B[8][8], C[8][8];
  for (int l = 0; l < 32; ++l) {
    int r, c;
    metal::simdgroup_lane_coord(static_cast<uint>(l), r, c);
    const float* p = static_cast<const float*>(v.in[l]);
    A[r][c] = p[0]; A[r][c + 1] = p[1];
    B[r][c] = p[2]; B[r][c + 1] = p[3];
    C[r][c] = p[4]; C[r][c + 1] = p[5];
  }
  for (int l = 0; l < 32; ++l) {
    int r, c;
    metal::simdgroup_lane_coord(static_cast<uint>(l), r, c);
    float* o = static_cast<float*>(v.out[l]);
    for (int k = 0; k < 2; ++k) {
      float acc = C[r][c + k];
      for (int j = 0; j < 8; ++j) acc += A[r][j] * B[j][c + k];
      o[k] = acc;
    }
  }
}
}  // namespace mtl_emu

namespace metal {
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b,
                                   const simdgroup_matrix<TC, 8, 8>& c, MTL_EMU_LOC) {
  float in[6] = {static_cast<float>(a.e[0]), static_cast<float>(a.e[1]), static_cast<float>(b.e[0]),
                 static_cast<float>(b.e[1]), static_cast<float>(c.e[0]), static_cast<float>(c.e[1])};
  float out[2];
  mtl_emu::collective(in, out, 0, &mtl_emu::mma_combine, "simdgroup_multiply_accumulate", file, line);
  d.e[0] = static_cast<TD>(out[0]);
  d.e[1] = static_cast<TD>(out[1]);
}
template <class TD, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b, MTL_EMU_LOC) {
  simdgroup_matrix<float, 8, 8> zero;
  zero.e[0] = 0.0f;
  zero.e[1] = 0.0f;
  simdgroup_multiply_accumulate(d, a, b, zero, file, line);
}
#undef MTL_EMU_LOC

}  // namespace metal

// Global names MSL code uses without `metal::`.
using metal::bfloat;
using metal::bfloat16_t;
using metal::vec;
using metal::float2; using metal::float3; using metal::float4;
using metal::half2; using metal::half3; using metal::half4;
using metal::bfloat2; using metal::bfloat3; using metal::bfloat4;
using metal::int2; using metal::int3; using metal::int4;
using metal::uint2; using metal::uint3; using metal::uint4;
using metal::short2; using metal::short3; using metal::short4;
using metal::ushort2; using metal::ushort3; using metal::ushort4;
using metal::char2; using metal::char3; using metal::char4;
using metal::uchar2; using metal::uchar3; using metal::uchar4;
using metal::long2; using metal::long3; using metal::long4;
using metal::ulong2; using metal::ulong3; using metal::ulong4;
using metal::bool2; using metal::bool3; using metal::bool4;

// ------------------------------------------------- kernel argument binding

namespace mtl_emu {

inline constexpr int zero[1] = {0};

// A pointer into the `constant` address space. The pre-pass turns `constant T*`
// declarations into this type so that, as in Metal, it does not convert to a `device`
// pointer (passing one where a `device` pointer is expected is a compile error); reading
// through it works as through any pointer.
template <class T> struct constant_ptr {
  T* p;
  T& operator[](long i) const { return p[i]; }
  T& operator*() const { return *p; }
  T* operator->() const { return p; }
  constant_ptr operator+(long i) const { return {p + i}; }
  constant_ptr operator-(long i) const { return {p - i}; }
  constant_ptr& operator+=(long i) { p += i; return *this; }
  constant_ptr& operator++() { ++p; return *this; }
  long operator-(constant_ptr o) const { return p - o.p; }
  bool operator==(constant_ptr o) const { return p == o.p; }
  bool operator!=(constant_ptr o) const { return p != o.p; }
};

// The value of a [[buffer(n)]] default argument: converts to the parameter's
// pointer type, or to a reference (`constant Params& p`) after checking that
// the bound buffer holds at least sizeof(Params) bytes.
struct BufRef {
  int index;
  template <class T> operator T*() const { return static_cast<T*>(buffer_pointer(index, 0, "")); }
  template <class T> operator constant_ptr<T>() const {
    return {static_cast<T*>(buffer_pointer(index, 0, ""))};
  }
  template <class T> operator T&() const {
    return *static_cast<T*>(buffer_pointer(index, sizeof(T), type_name<T>()));
  }
};
struct BufTable {
  BufRef operator[](int i) const { return BufRef{i}; }
};
inline constexpr BufTable buffer_arg{};

struct TgParamRef {
  int index;
  template <class T> operator T*() const { return static_cast<T*>(threadgroup_param(index)); }
};
struct TgParamTable {
  TgParamRef operator[](int i) const { return TgParamRef{i}; }
};
inline constexpr TgParamTable tg_param_arg{};

enum PosKind {
  kPosInGrid, kPosInTg, kTgPos, kTgSize, kNGroups, kGridSize,   // 3-vectors
  kIndexInTg, kLane, kSimdgroup, kSimdWidth, kNSimdgroups,      // scalars
};

// The value of a position-attribute default argument: reads the running
// simulated thread's record, converting to uint/ushort (x component for
// vector attributes) or to 2-/3-vectors.
struct PosRef {
  int kind;
  const uint32_t* v3() const {
    const ThreadInfo* t = tl_thread;
    switch (kind) {
      case kPosInGrid: return t->pos_in_grid;
      case kPosInTg: return t->pos_in_tg;
      case kTgPos: return t->tg_pos;
      case kTgSize: return t->tg_size;
      case kNGroups: return t->n_groups;
      default: return t->grid_size;
    }
  }
  uint32_t scalar() const {
    const ThreadInfo* t = tl_thread;
    switch (kind) {
      case kIndexInTg: return t->index_in_tg;
      case kLane: return t->lane;
      case kSimdgroup: return t->simdgroup;
      case kSimdWidth: return t->simd_width;
      case kNSimdgroups: return t->n_simdgroups;
      default: return v3()[0];
    }
  }
  operator uint() const { return scalar(); }
  operator ushort() const { return static_cast<ushort>(scalar()); }
  operator metal::uint2() const { const uint32_t* p = v3(); return metal::uint2(p[0], p[1]); }
  operator metal::uint3() const { const uint32_t* p = v3(); return metal::uint3(p[0], p[1], p[2]); }
  operator metal::ushort2() const { const uint32_t* p = v3(); return metal::ushort2(p[0], p[1]); }
  operator metal::ushort3() const { const uint32_t* p = v3(); return metal::ushort3(p[0], p[1], p[2]); }
};
struct PosTable {
  PosRef operator[](int k) const { return PosRef{k}; }
};
inline constexpr PosTable pos_arg{};

// Threadgroup variables (see the pre-pass): one allocation per declaration
// site and threadgroup, poisoned with 0xFF bytes when first touched.
template <class A> using tg_ref = A&;
template <class A> A& tg_array(const void* site, const char* file, int line) {
  return *static_cast<A*>(threadgroup_alloc(site, sizeof(A), alignof(A), file, line));
}

struct Registrar {
  Registrar(const char* name, void (*fn)()) { register_kernel(name, fn); }
};

}  // namespace mtl_emu

// A unique address per threadgroup declaration and template instantiation.
#define MTL_EMU_TG_SITE ([]() -> const void* { static char site_; return &site_; }())
#define MTL_EMU_REGISTER(id, name, ...) \
  static ::mtl_emu::Registrar id(name, []() { __VA_ARGS__(); });

// --------------------------------------------------- MSL keywords/attributes
// Defined last, so that nothing above is affected.

#define device
#define constant
#define thread
#define threadgroup
#define kernel
#define buffer(n) ]] = ::mtl_emu::buffer_arg[(n) + ::mtl_emu::zero[0
#define mtl_emu_threadgroup_param(n) ]] = ::mtl_emu::tg_param_arg[(n) + ::mtl_emu::zero[0
// Position attributes: the pre-pass rewrites `[[thread_index_in_simdgroup]]` into
// `[[MTL_EMU_POS(kLane)]]` (source.POSITION_ATTRIBUTES), so variables may carry the
// attribute's name, as MLX's generated kernels do.
#define MTL_EMU_POS(k) ]] = ::mtl_emu::pos_arg[::mtl_emu::k + ::mtl_emu::zero[0
#define max_total_threads_per_threadgroup(n)
// A course stub stops the run with the task's message (see tiny_llm/course/tasks.py).
#define TINY_LLM_TASK_STUB(message) ::mtl_emu::fail(::mtl_emu::kErrOther, message)

#define HALF_MAX 65504.0f
#define MAXFLOAT FLT_MAX
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
