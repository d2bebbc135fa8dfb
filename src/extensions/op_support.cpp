#include "op_support.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"

namespace tiny_llm {

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("tiny_llm ops: " + message);
}

void copy_strided(const char* src, char* dst, const mx::Shape& shape,
                  const mx::Strides& strides, size_t item) {
  const int nd = static_cast<int>(shape.size());
  std::vector<int64_t> index(nd, 0);
  int64_t total = 1;
  for (auto s : shape) total *= s;
  for (int64_t i = 0; i < total; ++i) {
    int64_t offset = 0;
    for (int d = 0; d < nd; ++d) offset += index[d] * strides[d];
    std::memcpy(dst + i * item, src + offset * item, item);
    for (int d = nd - 1; d >= 0 && ++index[d] == shape[d]; --d) index[d] = 0;
  }
}

mx::array row_major(const mx::array& a, mx::cpu::CommandEncoder& enc) {
  if (a.flags().row_contiguous) return a;
  mx::array copy(a.shape(), a.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  enc.add_temporary(copy);
  enc.dispatch([src = a.data<char>(), dst = copy.data<char>(), shape = a.shape(),
                strides = a.strides(), item = a.itemsize()]() {
    copy_strided(src, dst, shape, strides, item);
  });
  return copy;
}

mx::cpu::CommandEncoder& begin_cpu_eval(const mx::Stream& stream,
                                        const std::vector<mx::array>& inputs,
                                        std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    enc.set_output_array(out);
  }
  return enc;
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

}  // namespace tiny_llm
