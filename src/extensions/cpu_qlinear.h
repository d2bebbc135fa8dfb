// The CPU matmul of quantized linear layers: y [M, N] = x [M, K] @ W^T, where W is stored
// in MLX's affine layout (what mx.quantize writes and what GGUF's Q4_1 / Q8_0 blocks become
// in tiny_llm/models/loader.py): every `group` consecutive weights of a row share a scale s and a
// bias b, W[n, k] = s * q[n, k] + b, the q packed `32 / bits` to a uint32 from its low bits.
//
// The decode kernel never dequantizes: per group it sums q * x, then adds s * that sum and
// b * (the group's sum of x), so a decode step reads the packed bytes (4 bits a weight
// instead of float32's 32, plus the groups' scales and biases) once for all rows of the
// call. Each output is one fixed sequence of operations that depends only on K, the group
// size and the bit width (16 lanes over each group, the groups in order, a fixed tree at the
// end), never on M or on the other rows: batch invariance by construction, as in
// cpu_linear.h. Bit widths 4 and 8, groups a multiple of 32 (the formats of the default
// checkpoint and of mlx-lm's 4- and 8-bit models).
//
// Prefill rows are compute-bound: the blas variant dequantizes a block of weight rows into
// float32 (s * q + b, sixteen at a time) and multiplies it with MLX's BLAS, the blocks spread
// over the worker pool (Linux only, like linear_blas_split).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tiny_llm {

// The dtype scales and biases are stored in: float32, or float16 / bfloat16 as quantized
// checkpoints keep them (GGUF's Q4_1 and Q8_0 blocks hold float16 ones). The kernels read
// them as stored and widen them to float32, which is exact: the same products as from
// float32 copies, from half the bytes (a group of 32 4-bit weights is 16 bytes; its scale
// and bias take 4 bytes in half precision, 8 in float32).
enum class ScaleType : uint8_t { f32, f16, bf16 };

// One quantized weight matrix of a call and where its product goes.
struct QuantizedPart {
  const uint32_t* w;     // [N, K * bits / 32]
  const void* scales;    // [N, K / group], of scale_type
  const void* biases;    // [N, K / group], of scale_type
  float* y;              // [M, N]
  int64_t N;
  ScaleType scale_type;
};

struct QuantFormat {
  int group;
  int bits;
};

inline size_t scale_bytes(ScaleType t) { return t == ScaleType::f32 ? 4 : 2; }

// Whether the kernels below serve this format (others take MLX's quantized_matmul).
bool quantized_kernel_serves(QuantFormat format);

// Whether the int8 option serves this format: groups that divide 64-byte blocks of a row
// (128 weights at 4 bits, 64 at 8) or are a multiple of them.
bool int8_kernel_serves(QuantFormat format);

// int8: x rounded per 32 values to int8 (see "Int8 activations" above).
void quantized_linear_cpu(const float* x, const std::vector<QuantizedPart>& parts, int64_t M,
                          int64_t K, QuantFormat format, bool int8 = false);

void quantized_linear_blas_split(const float* x, const std::vector<QuantizedPart>& parts,
                                 int64_t M, int64_t K, QuantFormat format);

}  // namespace tiny_llm
