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
//   Both take gpu_rehearsal (tiny_llm/device.py): on a CPU stream, decide as a GPU stream
//   does (the Metal launcher's checks and plan; MLX's scatter as the write), then compute
//   on the CPU.
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
//   decoder_layers(decoder_run(layers, ...), x, k_pools, v_pools, positions, slot_mapping,
//       block_table, ...) -> the output of a run of decoder layers for decode rows in one
//       op, each layer's K/V rows written into its pools in place: bit for bit the ops
//       above in the op path's order, float32 on a CPU stream (cpu_decoder.h).
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
    bool gpu_rehearsal = false,
    mx::StreamOrDevice s = {});

std::tuple<mx::array, mx::array> paged_kv_write(
    const mx::array& k_pages,
    const mx::array& v_pages,
    const mx::array& k_new,
    const mx::array& v_new,
    const mx::array& slot_mapping,
    bool gpu_rehearsal = false,
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

// One decoder layer's weights as the Python side hands them over: the input norm's weight,
// the q/k/v projections, their biases (none, or q's, k's and v's), the per-head norms
// (none, or q's and k's), RoPE's inv_freq, the post-attention norm's weight, o_proj,
// gate/up and down.
using DecoderLayerArrays =
    std::tuple<mx::array, ProjectionArrays, std::vector<mx::array>, std::vector<mx::array>,
               mx::array, mx::array, ProjectionArrays, ProjectionArrays, ProjectionArrays>;

// What the layers of one run share, as the model's layers hold it.
struct DecoderLayersOptions {
  int n_heads, n_kv_heads, head_dim;
  float eps, post_eps;  // the input and post-attention norms'
  int rope_dims;
  bool rope_traditional;
  float rope_scale;
  float qk_eps;  // the per-head norms' eps (when the layers have them)
  float scale;   // attention's
};

// What decoder_layers reads of each layer beyond its arrays: the (group, bits) of its
// q/k/v, o, gate/up and down projections, and whether it has q/k/v biases and head norms.
struct DecoderLayerFormat {
  std::array<std::pair<int, int>, 4> projections;
  bool biases, qk_norms;
};

// A run of consecutive decoder layers, checked once: their weights in the order the op
// reads them (per layer: input norm, inv_freq, post norm, the arrays of q/k/v, the biases
// and head norms where it has them, the arrays of o_proj, gate/up and down).
struct DecoderRun {
  std::vector<mx::array> weights;
  std::vector<DecoderLayerFormat> formats;
  DecoderLayersOptions options;
  int64_t dim;
};

DecoderRun decoder_run(const std::vector<DecoderLayerArrays>& layers,
                       const DecoderLayersOptions& options);

// The run's output for decode rows x [T, dim]; layer i's K/V rows are written in place into
// k_pools[i] and v_pools[i], float32 [P, page_size, n_kv_heads, head_dim] and row-contiguous,
// which nothing else may hold (the caller checks that with MLX's is_donatable). tiled and
// int8 as paged_attention's and quantized_linear's.
mx::array decoder_layers(const DecoderRun& run, const mx::array& x,
                         const std::vector<mx::array>& k_pools,
                         const std::vector<mx::array>& v_pools, const mx::array& positions,
                         const mx::array& slot_mapping, const mx::array& block_table,
                         const mx::array& context_lens, const mx::array& query_start_loc,
                         bool tiled, bool int8, mx::StreamOrDevice s = {});

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
  bool is_equivalent(const mx::Primitive&) const override { return true; }
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

// Inputs: x, positions, slot_mapping, block_table, context_lens, query_start_loc, each
// layer's k and v pools, then the run's weights. Output: the last layer's. The pools are
// written in place.
class DecoderLayers : public mx::Primitive {
 public:
  DecoderLayers(mx::Stream stream, DecoderLayersOptions options,
                std::vector<DecoderLayerFormat> formats, bool tiled, bool int8)
      : mx::Primitive(stream), options_(options), formats_(std::move(formats)), tiled_(tiled),
        int8_(int8) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DecoderLayers"; }

 private:
  DecoderLayersOptions options_;
  std::vector<DecoderLayerFormat> formats_;
  bool tiled_, int8_;
};

}  // namespace tiny_llm
