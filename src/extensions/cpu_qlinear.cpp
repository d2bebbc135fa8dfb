// The CPU matmul of quantized linear layers (see cpu_qlinear.h): the entry points, which
// share a call's weight rows out over the worker pool. The kernels they call, by role:
// cpu_qlinear_lanes.h (the lanes per instruction set), cpu_qlinear_formats.h (the stored
// scales), cpu_qlinear_float.h (the float kernel), cpu_qlinear_int8.h (the int8 kernel).
#include "cpu_qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include "cpu_linear.h"
#include "cpu_qlinear_float.h"
#include "cpu_qlinear_formats.h"
#include "cpu_qlinear_int8.h"
#include "cpu_qlinear_lanes.h"
#include "profile.h"
#include "worker_pool.h"

namespace tiny_llm {

namespace {

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
  ProfileScope profile(Phase::kProjections);
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
  // With float activations a weight row costs unpacking for each row of x: from 16 rows of
  // x on, a part's items are split further (by rows of x / 8), so that the last items of a
  // job are short and a thread that runs slower than the other (a busy neighbour on its
  // core) does not leave it waiting at the end of every job.
  const int64_t block_rows = 64;
  const int64_t m_blocks = (M + block_rows - 1) / block_rows;
  const int64_t split = int8 ? 1 : std::max<int64_t>(1, std::min(M, block_rows) / 8);
  std::vector<int64_t> first{0}, item_rows;
  int64_t weight_rows = 0;
  for (const auto& part : parts) {
    const int64_t row_cost = row_bytes + 2 * groups * scale_bytes(part.scale_type);
    const int64_t items =
        even_items(part.N, std::max<int64_t>(1, part.N * row_cost / 131072) * split);
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
SIMD_INLINE void store_interleaved(const F16& a, const F16& b, float* out) {
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
  ProfileScope profile(Phase::kProjections);
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
