// The model's elementwise layers on the CPU (see cpu_layers.h).
#include "cpu_layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_simd.h"
#include "profile.h"
#include "worker_pool.h"

namespace tiny_llm {

void rope_cpu(const float* x, const int32_t* positions, const float* inv_freq, float* out,
              const RopeShape& g) {
  ProfileScope profile(Phase::kVectorOps);
  const int half = g.dims / 2;
  const int64_t row_size = g.heads * g.head_dim;
  // The pair (a, b) of pair i: interleaved, or one element from each half.
  const int first_step = g.traditional ? 2 : 1;
  const int second_offset = g.traditional ? 1 : half;
  parallel_for(static_cast<int>(g.rows), 20.0 * row_size, [&](int t) {
    std::vector<float> cos_t(half), sin_t(half);
    const float position = static_cast<float>(positions[t]) * g.scale;
    for (int i = 0; i < half; ++i) {
      const float theta = position * inv_freq[i];
      cos_t[i] = std::cos(theta);
      sin_t[i] = std::sin(theta);
    }
    const float* src = x + t * row_size;
    float* dst = out + t * row_size;
    for (int64_t h = 0; h < g.heads; ++h) {
      const float* xs = src + h * g.head_dim;
      float* ys = dst + h * g.head_dim;
      for (int i = 0; i < half; ++i) {
        const int a = i * first_step, b = a + second_offset;
        ys[a] = xs[a] * cos_t[i] - xs[b] * sin_t[i];
        ys[b] = xs[a] * sin_t[i] + xs[b] * cos_t[i];
      }
      if (g.dims < g.head_dim)
        std::memcpy(ys + g.dims, xs + g.dims, (g.head_dim - g.dims) * sizeof(float));
    }
  });
}

// Eight columns at a time with exp8 (std::exp runs one element at a time), the last
// cols % 8 as a partial vector, so that every element takes the same arithmetic wherever it
// sits.
void swiglu_cpu(const float* gate, const float* up, float* out, int64_t rows, int64_t cols) {
  ProfileScope profile(Phase::kVectorOps);
  parallel_for(static_cast<int>(rows), 20.0 * cols, [&](int r) {
    const float* g = gate + r * cols;
    const float* u = up + r * cols;
    float* y = out + r * cols;
    for (int64_t i = 0; i < cols; i += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, cols - i));
      const simd::Lanes8 gv = n == 8 ? simd::load8(g + i) : simd::load8(g + i, 0, n);
      const simd::Lanes8 uv = n == 8 ? simd::load8(u + i) : simd::load8(u + i, 0, n);
      const simd::Lanes8 yv = gv / (1.0f + simd::exp8(-gv)) * uv;
      std::memcpy(y + i, &yv, sizeof(float) * n);
    }
  });
}

void rms_norm_cpu(const float* x, const float* weight, float* out, int64_t rows, int64_t cols,
                  float eps) {
  ProfileScope profile(Phase::kVectorOps);
  parallel_for(static_cast<int>(rows), 4.0 * cols, [&](int r) {
    const float* xs = x + r * cols;
    float* ys = out + r * cols;
    float squares = 0.0f;  // one row's own sum: no other row changes it
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < cols; ++i) squares += xs[i] * xs[i];
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(cols) + eps);
    for (int64_t i = 0; i < cols; ++i) ys[i] = xs[i] * scale * weight[i];
  });
}

// Two passes over a row: its largest number, eight lanes at a time, noting any NaN on the
// way; then the first index holding a NaN if it has one (a NaN outranks every number), else
// the first holding the largest number.
void argmax_rows_cpu(const float* x, uint32_t* out, int64_t rows, int64_t cols) {
  parallel_for(static_cast<int>(rows), 2.0 * cols, [&](int r) {
    const float* v = x + r * cols;
    simd::Lanes8 best = simd::splat<simd::Lanes8>(-INFINITY);
    simd::Ints8 nans = {};
    int64_t i = 0;
    for (; i + 8 <= cols; i += 8) {
      const simd::Lanes8 a = simd::load8(v + i);
      best = a > best ? a : best;
      nans |= a != a;
    }
    float m = -INFINITY;
    bool nan = false;
    for (int l = 0; l < 8; ++l) {
      m = best[l] > m ? best[l] : m;
      nan = nan || nans[l] != 0;
    }
    for (; i < cols; ++i) {
      m = v[i] > m ? v[i] : m;
      nan = nan || v[i] != v[i];
    }
    int64_t at = 0;
    if (nan) {
      while (v[at] == v[at]) ++at;
    } else {
      while (v[at] != m) ++at;  // m is one of the row's values (cols >= 1)
    }
    out[r] = static_cast<uint32_t>(at);
  });
}

}  // namespace tiny_llm
