// The model's matmuls as MLX ops on a CPU stream (cpu_linear.h, cpu_qlinear.h).
//
//   linear(x [M, K], [w_i [N_i, K], ...], blas) -> [x @ w_i^T [M, N_i], ...], float32 on a
//       CPU stream: the model's matmuls, each weight row read once for all rows (the decode
//       rows), or with blas, MLX's BLAS split over the worker pool (the prefill rows); the
//       weights of one call share one run of the pool (cpu_linear.h).
//   quantized_linear(x [M, K], [(w_i, scales_i, biases_i), ...], group, bits, blas, int8)
//       -> [x @ W_i^T [M, N_i], ...], W_i in MLX's affine layout (packed uint32 w_i
//       [N_i, K * bits / 32], scales_i and biases_i [N_i, K / group] in float32, or in
//       float16 or bfloat16 as stored), on a CPU stream: the decode rows from the packed
//       bytes (with int8, x rounded to int8 per 32 values first), or with blas the prefill
//       rows from dequantized blocks by MLX's BLAS (cpu_qlinear.h).
#pragma once

#include <vector>

#include "cpu_qlinear.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace tiny_llm {

namespace mx = mlx::core;

std::vector<mx::array> linear(const mx::array& x, const std::vector<mx::array>& weights,
                              bool blas = false, mx::StreamOrDevice s = {});

std::vector<mx::array> quantized_linear(const mx::array& x,
                                        const std::vector<mx::array>& weights,
                                        const std::vector<mx::array>& scales,
                                        const std::vector<mx::array>& biases, int group,
                                        int bits, bool blas = false, bool int8 = false,
                                        mx::StreamOrDevice s = {});

// Quantized layers' scales and biases: of one float dtype, read as stored (cpu_qlinear.h).
bool serves_scales(const mx::array& scales, const mx::array& biases);
ScaleType scale_type(mx::Dtype t);

// Inputs: x [M, K] and the weights w_i [N_i, K], float32. Outputs: x @ w_i^T [M, N_i].
class Linear : public mx::Primitive {
 public:
  Linear(mx::Stream stream, bool blas) : mx::Primitive(stream), blas_(blas) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "Linear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return blas_ == static_cast<const Linear&>(other).blas_;
  }

 private:
  bool blas_;
};

// Inputs: x [M, K] float32, then (w_i, scales_i, biases_i) per part. Outputs: x @ W_i^T.
class QuantizedLinear : public mx::Primitive {
 public:
  QuantizedLinear(mx::Stream stream, int group, int bits, bool blas, bool int8)
      : mx::Primitive(stream), group_(group), bits_(bits), blas_(blas), int8_(int8) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "QuantizedLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedLinear&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && blas_ == o.blas_ && int8_ == o.int8_;
  }

 private:
  int group_, bits_;
  bool blas_, int8_;
};

}  // namespace tiny_llm
