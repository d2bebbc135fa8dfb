// Paged attention ops for tiny_llm: one block-table interface, CPU kernels in C++
// (cpu_attention.cpp) and Metal kernels JIT-compiled by MLX on Apple GPUs (metal_launch.cpp).
//
//   paged_attention(q [T, Hq, D], k_pages, v_pages [P, page_size, Hkv, D],
//                   block_table int32 [B, max_pages], context_lens int32 [B],
//                   query_start_loc int32 [B + 1], scale, tiled) -> [T, Hq, D]
//       tiled: rows of multi-token queries take the tiled schedule (Day 5); otherwise
//       every row takes the vector schedule (Day 4).
//   paged_kv_write(k_pages, v_pages, k_new, v_new [T, Hkv, D], slot_mapping int32 [T])
//       -> (k_pages, v_pages), written in place when the pool is donatable.
//
//   linear(x [M, K], [w_i [N_i, K], ...], blas) -> [x @ w_i^T [M, N_i], ...], float32 on a
//       CPU stream: the model's matmuls, each weight row read once for all rows (the decode
//       rows), or with blas, MLX's BLAS split over the worker pool (the prefill rows); the
//       weights of one call share one run of the pool (cpu_linear.h).
//   quantized_linear(x [M, K], [(w_i, scales_i, biases_i), ...], group, bits, blas, int8)
//       -> [x @ W_i^T [M, N_i], ...], W_i in MLX's affine layout (packed uint32 w_i
//       [N_i, K * bits / 32], scales_i and biases_i [N_i, K / group] in float32, or in
//       float16 or bfloat16 as stored), on a CPU stream: the decode rows from the packed bytes (with int8, x rounded to int8 per
//       32 values first), or with blas the prefill rows from dequantized blocks by MLX's
//       BLAS (cpu_qlinear.h).
//   rope(x [T, H, D], positions int32 [T], inv_freq [dims / 2], dims, traditional, scale)
//       -> [T, H, D], float32 on a CPU stream: RoPE with a position per row (cpu_layers.h).
//   swiglu(gate, up) -> silu(gate) * up, float32 on a CPU stream (cpu_layers.h).
//   rms_norm(x [..., D], weight [D], eps) -> x normalised over its last axis, float32 on a
//       CPU stream (cpu_layers.h).
//   decoder_qkv(x, ...) -> (q, k, v) and decoder_rest(h, q, pages, ...) -> the layer's
//       output: a decoder layer of decode rows in two ops around paged_kv_write, bit for
//       bit the ops above in the op path's order, float32 on a CPU stream (cpu_decoder.h).
//
// Metadata is validated by the Python wrapper (tiny_llm/day4_paged_attention.py) before
// any kernel runs; these ops check only shapes and dtypes.
#pragma once

#include <array>
#include <tuple>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace tiny_llm {

namespace mx = mlx::core;

mx::array paged_attention(
    const mx::array& q,
    const mx::array& k_pages,
    const mx::array& v_pages,
    const mx::array& block_table,
    const mx::array& context_lens,
    const mx::array& query_start_loc,
    float scale,
    bool tiled = true,
    mx::StreamOrDevice s = {});

std::tuple<mx::array, mx::array> paged_kv_write(
    const mx::array& k_pages,
    const mx::array& v_pages,
    const mx::array& k_new,
    const mx::array& v_new,
    const mx::array& slot_mapping,
    mx::StreamOrDevice s = {});

std::vector<mx::array> linear(const mx::array& x, const std::vector<mx::array>& weights,
                              bool blas = false, mx::StreamOrDevice s = {});

std::vector<mx::array> quantized_linear(const mx::array& x,
                                        const std::vector<mx::array>& weights,
                                        const std::vector<mx::array>& scales,
                                        const std::vector<mx::array>& biases, int group,
                                        int bits, bool blas = false, bool int8 = false,
                                        mx::StreamOrDevice s = {});

mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freq,
               int dims, bool traditional, float scale, mx::StreamOrDevice s = {});

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

// A layer's projections of one input as the Python side hands them over: the arrays
// (w_i for float32 weights, bits 0; w_i, scales_i, biases_i for MLX's affine layout), the
// group size and the bit width.
using ProjectionArrays = std::tuple<std::vector<mx::array>, int, int>;

// The rotation and norms of decoder_qkv, as the model's layers hold them.
struct DecoderQkvOptions {
  int n_heads, n_kv_heads;
  float eps;
  int rope_dims;
  bool rope_traditional;
  float rope_scale;
  float qk_eps;  // the per-head norms' eps (when q_norm and k_norm are given)
  bool int8;
};

std::vector<mx::array> decoder_qkv(const mx::array& x, const mx::array& norm_weight,
                                   const ProjectionArrays& qkv, const mx::array& positions,
                                   const mx::array& inv_freq,
                                   const std::vector<mx::array>& qkv_biases,
                                   const std::vector<mx::array>& qk_norms,
                                   const DecoderQkvOptions& options, mx::StreamOrDevice s = {});

mx::array decoder_rest(const mx::array& h, const mx::array& q, const mx::array& k_pages,
                       const mx::array& v_pages, const mx::array& block_table,
                       const mx::array& context_lens, const mx::array& query_start_loc,
                       float scale, bool tiled, const ProjectionArrays& o_proj,
                       const mx::array& post_norm, float eps, const ProjectionArrays& gate_up,
                       const ProjectionArrays& down, bool int8, mx::StreamOrDevice s = {});

// How many times paged_kv_write had to copy a pool because it was not donatable
// (another reference was alive). The engine keeps this at 0; tests and benches read it.
int pool_copies();

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, float scale, bool tiled)
      : mx::Primitive(stream), scale_(scale), tiled_(tiled) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  bool tiled_;
};

// Inputs: one pool, its new rows, the slot mapping. Output: the pool after the write.
class PagedKVWrite : public mx::Primitive {
 public:
  explicit PagedKVWrite(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PagedKVWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

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
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
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

// Inputs: x, norm weight, positions, inv_freq, the q/k/v projections' arrays, then the
// three biases and the two head norms where the layer has them. Outputs: q, k, v.
class DecoderQkv : public mx::Primitive {
 public:
  DecoderQkv(mx::Stream stream, DecoderQkvOptions options, int group, int bits, bool biases,
             bool qk_norms)
      : mx::Primitive(stream), options_(options), group_(group), bits_(bits), biases_(biases),
        qk_norms_(qk_norms) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DecoderQkv"; }

 private:
  DecoderQkvOptions options_;
  int group_, bits_;
  bool biases_, qk_norms_;
};

// Inputs: h, q, k_pages, v_pages, block_table, context_lens, query_start_loc, the post-
// attention norm's weight, then the arrays of o_proj, gate/up and down. Output: the layer's.
class DecoderRest : public mx::Primitive {
 public:
  // formats: (group, bits) of o_proj, gate/up and down
  DecoderRest(mx::Stream stream, float scale, bool tiled, float eps,
              std::array<std::pair<int, int>, 3> formats, bool int8)
      : mx::Primitive(stream), scale_(scale), tiled_(tiled), eps_(eps), formats_(formats),
        int8_(int8) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DecoderRest"; }

 private:
  float scale_;
  bool tiled_;
  float eps_;
  std::array<std::pair<int, int>, 3> formats_;
  bool int8_;
};

}  // namespace tiny_llm
