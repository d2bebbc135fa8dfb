// A decoder layer's elementwise pieces as one MLX op each on a CPU stream (cpu_layers.h).
//
//   rope(x [T, H, D], positions int32 [T], inv_freq [dims / 2], dims, traditional, scale)
//       -> [T, H, D], float32 on a CPU stream: RoPE with a position per row (cpu_layers.h).
//   swiglu(gate, up) -> silu(gate) * up, float32 on a CPU stream (cpu_layers.h).
//   rms_norm(x [..., D], weight [D], eps) -> x normalised over its last axis, float32 on a
//       CPU stream (cpu_layers.h).
//   argmax_rows(x [R, V]) -> uint32 [R], each row's mx.argmax, float32 on a CPU stream: the
//       greedy sampler's pick (cpu_layers.h).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace tiny_llm {

namespace mx = mlx::core;

mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freq,
               int dims, bool traditional, float scale, mx::StreamOrDevice s = {});

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

mx::array argmax_rows(const mx::array& x, mx::StreamOrDevice s = {});

// Inputs: x [T, H, D] float32, positions int32 [T], inv_freq float32 [dims / 2].
class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "Rope"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

// Inputs: gate and up, float32 of one shape.
class SwiGLU : public mx::Primitive {
 public:
  explicit SwiGLU(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// Inputs: x [..., D] and weight [D], float32.
class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "RmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

// Input: x [R, V] float32, V >= 1.
class ArgmaxRows : public mx::Primitive {
 public:
  explicit ArgmaxRows(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ArgmaxRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace tiny_llm
