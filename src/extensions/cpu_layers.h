// The model's elementwise layers on the CPU, each one op where MLX's CPU back end runs a
// chain of them (RoPE with a position per row) or a slow scalar exp (SiLU).
//
// rope: rotary position embedding for a flat batch, every row at its own position. For
// row t at position p and pair i < dims / 2, theta = (p * scale) * inv_freq[i]; the
// pair (x[2i], x[2i+1]) (traditional, llama.cpp's layout) or (x[i], x[i + dims/2]) (the
// halves, Hugging Face's layout) of every head is rotated by theta. Elements past `dims`
// are copied. The cosines and sines of a row are computed once for all its heads.
//
// swiglu: silu(gate) * up = gate / (1 + exp(-gate)) * up, the MLP's activation.
//
// rms_norm: x * (1 / sqrt(mean(x^2) + eps)) * weight over each row, as mx.fast.rms_norm
// defines it (MLX's CPU back end runs it as a chain of ops, each a pass over the rows; here
// it is one pass).
//
// argmax_rows: each row's index of its largest value, as mx.argmax defines it (the lowest
// index among equal values; a NaN is larger than any number), for the greedy sampler: MLX's
// CPU argmax compares one element at a time.
#pragma once

#include <cstdint>

namespace tiny_llm {

struct RopeShape {
  int64_t rows, heads, head_dim;
  int dims;
  bool traditional;
  float scale;
};

void rope_cpu(const float* x, const int32_t* positions, const float* inv_freq, float* out,
              const RopeShape& shape);

void swiglu_cpu(const float* gate, const float* up, float* out, int64_t rows, int64_t cols);

void rms_norm_cpu(const float* x, const float* weight, float* out, int64_t rows, int64_t cols,
                  float eps);

void argmax_rows_cpu(const float* x, uint32_t* out, int64_t rows, int64_t cols);

}  // namespace tiny_llm
