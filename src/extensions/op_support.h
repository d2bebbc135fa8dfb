// What every op family's entry points and eval_cpu share: argument checks, row-major views
// of strided inputs, and the start of an eval_cpu (allocate the outputs, hand the arrays to
// the stream's encoder).
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace tiny_llm {

namespace mx = mlx::core;

// An invalid argument, in the ops' words.
void check(bool ok, const std::string& message);

// Row-major copy of a strided array (element strides), one element at a time.
void copy_strided(const char* src, char* dst, const mx::Shape& shape,
                  const mx::Strides& strides, size_t item);

// `a` itself when it is row-major, else a row-major copy made on the stream (a temporary
// of the encoder: it lives until the kernel that reads it has run).
mx::array row_major(const mx::array& a, mx::cpu::CommandEncoder& enc);

// The start of an eval_cpu: allocate the outputs now, hand the arrays to the stream's
// encoder, and return the encoder.
mx::cpu::CommandEncoder& begin_cpu_eval(const mx::Stream& stream,
                                        const std::vector<mx::array>& inputs,
                                        std::vector<mx::array>& outputs);

bool is_float(mx::Dtype t);

}  // namespace tiny_llm
