// RMSNorm, RoPE and SwiGLU: entry points and MLX primitives (see layer_ops.h).
#include "layer_ops.h"

#include <stdexcept>

#include "cpu_layers.h"
#include "mlx/backend/cpu/encoder.h"
#include "op_support.h"

namespace tiny_llm {

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  auto& out = outputs[0];
  const auto x = row_major(inputs[0], enc);
  const auto positions = row_major(inputs[1], enc);
  const auto inv_freq = row_major(inputs[2], enc);
  const RopeShape g{x.shape(0), x.shape(1), x.shape(2), dims_, traditional_, scale_};
  enc.dispatch([x = x.data<float>(), p = positions.data<int32_t>(),
                f = inv_freq.data<float>(), y = out.data<float>(), g]() {
    rope_cpu(x, p, f, y, g);
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("Rope: GPU streams use mx.fast.rope (tiny_llm/models/model.py)");
}

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  auto& out = outputs[0];
  const auto gate = row_major(inputs[0], enc);
  const auto up = row_major(inputs[1], enc);
  const int64_t cols = gate.ndim() ? gate.shape(-1) : 1;
  enc.dispatch([g = gate.data<float>(), u = up.data<float>(), y = out.data<float>(),
                rows = cols ? static_cast<int64_t>(gate.size()) / cols : 0, cols]() {
    swiglu_cpu(g, u, y, rows, cols);
  });
}

void SwiGLU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("SwiGLU: GPU streams use MLX's ops (tiny_llm/models/model.py)");
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  auto& out = outputs[0];
  const auto x = row_major(inputs[0], enc);
  const auto weight = row_major(inputs[1], enc);
  const int64_t cols = x.shape(-1);
  enc.dispatch([x = x.data<float>(), w = weight.data<float>(), y = out.data<float>(),
                rows = cols ? static_cast<int64_t>(x.size()) / cols : 0, cols, eps = eps_]() {
    rms_norm_cpu(x, w, y, rows, cols, eps);
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("RmsNorm: GPU streams use mx.fast.rms_norm (tiny_llm/kernels/cpu_kernels.py)");
}

void ArgmaxRows::eval_cpu(const std::vector<mx::array>& inputs,
                          std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  const auto x = row_major(inputs[0], enc);
  enc.dispatch([x = x.data<float>(), y = outputs[0].data<uint32_t>(), rows = x.shape(0),
                cols = x.shape(1)]() { argmax_rows_cpu(x, y, rows, cols); });
}

void ArgmaxRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("ArgmaxRows: GPU streams use mx.argmax (tiny_llm/kernels/cpu_kernels.py)");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
}

mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freq,
               int dims, bool traditional, float scale, mx::StreamOrDevice s) {
  check(x.ndim() == 3 && x.dtype() == mx::float32, "rope needs float32 x [T, H, D]");
  check(dims > 0 && dims % 2 == 0 && dims <= x.shape(2),
        "rope's dims must be even and at most the head size");
  check(positions.dtype() == mx::int32 && positions.ndim() == 1 &&
            positions.shape(0) == x.shape(0),
        "rope needs int32 positions [T]");
  check(inv_freq.dtype() == mx::float32 && inv_freq.ndim() == 1 &&
            inv_freq.shape(0) == dims / 2,
        "rope needs float32 inv_freq [dims / 2]");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "rope runs on CPU streams only");
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(stream, dims, traditional, scale),
                   {x, positions, inv_freq});
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  check(gate.dtype() == mx::float32 && up.dtype() == mx::float32 && gate.shape() == up.shape(),
        "swiglu needs float32 gate and up of one shape");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "swiglu runs on CPU streams only");
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream), {gate, up});
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s) {
  check(x.dtype() == mx::float32 && weight.dtype() == mx::float32 && x.ndim() >= 1 &&
            weight.ndim() == 1 && weight.shape(0) == x.shape(-1),
        "rms_norm needs float32 x [..., D] and weight [D]");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "rms_norm runs on CPU streams only");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps), {x, weight});
}

mx::array argmax_rows(const mx::array& x, mx::StreamOrDevice s) {
  check(x.dtype() == mx::float32 && x.ndim() == 2 && x.shape(1) >= 1,
        "argmax_rows needs float32 x [R, V] with V >= 1");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "argmax_rows runs on CPU streams only");
  return mx::array({x.shape(0)}, mx::uint32, std::make_shared<ArgmaxRows>(stream), {x});
}

}  // namespace tiny_llm
