// A decode step's run of decoder layers as one MLX op on a CPU stream (cpu_decoder.h).
//
//   decoder_layers(decoder_run(layers, ...), x, k_pools, v_pools, positions, slot_mapping,
//       block_table, ...) -> the output of a run of decoder layers for decode rows in one
//       op, each layer's K/V rows written into its pools in place: bit for bit the ops of
//       layer_ops.h, linear_ops.h and paged_ops.h in the op path's order, float32 on a CPU
//       stream (cpu_decoder.h).
#pragma once

#include <array>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_decoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace tiny_llm {

namespace mx = mlx::core;

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

// A run of consecutive decoder layers, checked once: their weights (evaluated and
// row-contiguous, per layer: input norm, inv_freq, post norm, the arrays of q/k/v, the
// biases and head norms where it has them, the arrays of o_proj, gate/up and down), and
// the layers as decoder_layers_cpu reads them, pointing into those weights: with float
// activations (layers[0]) and with int8 ones (layers[1]). The op holds the run, not the
// weights as its graph's inputs: a decode step's graph then has the step's arrays and the
// pools only, where the weights made it hundreds of inputs for MLX to visit every step.
struct DecoderRun {
  std::vector<mx::array> weights;
  std::vector<DecoderLayerFormat> formats;
  DecoderLayersOptions options;
  int64_t dim;
  std::array<std::vector<DecoderLayer>, 2> layers;
};

std::shared_ptr<const DecoderRun> decoder_run(const std::vector<DecoderLayerArrays>& layers,
                                              const DecoderLayersOptions& options);

// The run's output for decode rows x [T, dim]; layer i's K/V rows are written in place into
// k_pools[i] and v_pools[i], float32 [P, page_size, n_kv_heads, head_dim] and row-contiguous,
// which nothing else may hold (the caller checks that with MLX's is_donatable). tiled and
// int8 as paged_attention's and quantized_linear's.
mx::array decoder_layers(const std::shared_ptr<const DecoderRun>& run, const mx::array& x,
                         const std::vector<mx::array>& k_pools,
                         const std::vector<mx::array>& v_pools, const mx::array& positions,
                         const mx::array& slot_mapping, const mx::array& block_table,
                         const mx::array& context_lens, const mx::array& query_start_loc,
                         bool tiled, bool int8, mx::StreamOrDevice s = {});

// Inputs: x, positions, slot_mapping, block_table, context_lens, query_start_loc, then
// each layer's k and v pools; the weights are the run's. Output: the last layer's. The
// pools are written in place.
class DecoderLayers : public mx::Primitive {
 public:
  DecoderLayers(mx::Stream stream, std::shared_ptr<const DecoderRun> run, bool tiled, bool int8)
      : mx::Primitive(stream), run_(std::move(run)), tiled_(tiled), int8_(int8) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DecoderLayers"; }

 private:
  std::shared_ptr<const DecoderRun> run_;
  bool tiled_, int8_;
};

}  // namespace tiny_llm
