// The matmuls' entry points and MLX primitives (see linear_ops.h).
#include "linear_ops.h"

#include <stdexcept>
#include <vector>

#include "cpu_linear.h"
#include "mlx/backend/cpu/encoder.h"
#include "op_support.h"

namespace tiny_llm {

bool serves_scales(const mx::array& scales, const mx::array& biases) {
  return is_float(scales.dtype()) && biases.dtype() == scales.dtype();
}

ScaleType scale_type(mx::Dtype t) {
  return t == mx::float16 ? ScaleType::f16 : t == mx::bfloat16 ? ScaleType::bf16 : ScaleType::f32;
}

// ANCHOR: cpu_linear_eval
void Linear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  const auto x = row_major(inputs[0], enc);
  std::vector<LinearPart> parts;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto w = row_major(inputs[i + 1], enc);
    parts.push_back({w.data<float>(), outputs[i].data<float>(), w.shape(0)});
  }
  enc.dispatch([x = x.data<float>(), parts = std::move(parts), m = x.shape(0), k = x.shape(1),
                blas = blas_]() {
    if (blas) {
      linear_blas_split(x, parts, m, k);
    } else {
      linear_cpu(x, parts, m, k);
    }
  });
}
// ANCHOR_END: cpu_linear_eval

void Linear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("Linear: GPU streams use MLX's matmul (tiny_llm/kernels/cpu_kernels.py)");
}

void QuantizedLinear::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  const auto x = row_major(inputs[0], enc);
  std::vector<QuantizedPart> parts;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto w = row_major(inputs[3 * i + 1], enc);
    const auto scales = row_major(inputs[3 * i + 2], enc);
    const auto biases = row_major(inputs[3 * i + 3], enc);
    parts.push_back({w.data<uint32_t>(), scales.data<void>(), biases.data<void>(),
                     outputs[i].data<float>(), w.shape(0), scale_type(scales.dtype())});
  }
  enc.dispatch([x = x.data<float>(), parts = std::move(parts), m = x.shape(0), k = x.shape(1),
                format = QuantFormat{group_, bits_}, blas = blas_, int8 = int8_]() {
    if (blas) {
      quantized_linear_blas_split(x, parts, m, k, format);
    } else {
      quantized_linear_cpu(x, parts, m, k, format, int8);
    }
  });
}

void QuantizedLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "QuantizedLinear: GPU streams use MLX's quantized_matmul (tiny_llm/kernels/cpu_kernels.py)");
}

std::vector<mx::array> linear(const mx::array& x, const std::vector<mx::array>& weights,
                              bool blas, mx::StreamOrDevice s) {
  check(!weights.empty(), "linear needs one or more weights");
  check(x.ndim() == 2, "linear needs x [M, K] and w [N, K]");
  std::vector<mx::Shape> shapes;
  for (const auto& w : weights) {
    check(w.ndim() == 2 && w.shape(1) == x.shape(1), "linear needs x [M, K] and w [N, K]");
    check(w.dtype() == mx::float32, "linear computes in float32");
    shapes.push_back({x.shape(0), w.shape(0)});
  }
  check(x.dtype() == mx::float32, "linear computes in float32");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "linear runs on CPU streams only");
  check(!blas || kHasBlasSplit, "linear(blas=True) runs on Linux only");
  // Strided inputs are copied by the primitive itself: no extra graph nodes per call.
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  return mx::array::make_arrays(std::move(shapes),
                                std::vector<mx::Dtype>(weights.size(), mx::float32),
                                std::make_shared<Linear>(stream, blas), inputs);
}

std::vector<mx::array> quantized_linear(const mx::array& x,
                                        const std::vector<mx::array>& weights,
                                        const std::vector<mx::array>& scales,
                                        const std::vector<mx::array>& biases, int group,
                                        int bits, bool blas, bool int8, mx::StreamOrDevice s) {
  check(!weights.empty() && scales.size() == weights.size() && biases.size() == weights.size(),
        "quantized_linear needs one or more weights, each with its scales and biases");
  check(quantized_kernel_serves({group, bits}),
        "quantized_linear serves 4 and 8 bits in groups of a multiple of 32");
  check(x.ndim() == 2 && x.dtype() == mx::float32, "quantized_linear needs float32 x [M, K]");
  const int64_t K = x.shape(1);
  check(K % group == 0, "quantized_linear needs K a multiple of the group size");
  std::vector<mx::Shape> shapes;
  std::vector<mx::array> inputs{x};
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto &w = weights[i], &sc = scales[i], &b = biases[i];
    check(w.ndim() == 2 && w.dtype() == mx::uint32 && w.shape(1) == K * bits / 32,
          "quantized_linear needs packed uint32 weights [N, K * bits / 32]");
    const mx::Shape groups{w.shape(0), static_cast<int>(K / group)};
    check(sc.shape() == groups && b.shape() == groups && serves_scales(sc, b),
          "quantized_linear needs scales and biases [N, K / group] of one dtype: float32, "
          "float16 or bfloat16");
    shapes.push_back({x.shape(0), w.shape(0)});
    inputs.insert(inputs.end(), {w, sc, b});
  }
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "quantized_linear runs on CPU streams only");
  check(!blas || kHasBlasSplit, "quantized_linear(blas=True) runs on Linux only");
  check(!(blas && int8), "quantized_linear: int8 rows are decode rows, not blas=True ones");
  check(!int8 || int8_kernel_serves({group, bits}),
        "quantized_linear(int8=True) serves groups that divide 64 bytes of packed weights or "
        "are a multiple of them (32, 64 or 128 at 4 bits)");
  return mx::array::make_arrays(std::move(shapes),
                                std::vector<mx::Dtype>(weights.size(), mx::float32),
                                std::make_shared<QuantizedLinear>(stream, group, bits, blas, int8),
                                inputs);
}

}  // namespace tiny_llm
