// A decode step's decoder layers in one call on the CPU (tiny_llm/kernels/cpu_fused.py).
//
// Op by op, one layer of a decode step is about sixteen MLX ops (two norms, the
// projections, RoPE, the K/V write, attention, SwiGLU, two residual additions, reshapes),
// each built by Python and scheduled by MLX: for a one-row step of a small model those
// costs are a large share of the step (the book's performance appendix). Here a run of
// layers is one op; each layer is
//
//   decoder_qkv_cpu:  rms_norm, the q/k/v projections (+ their biases), the per-head q/k
//                     norms, RoPE                                     -> q, k, v
//   the K/V write:    k and v into the layer's pages at the step's slots, in place
//   decoder_rest_cpu: paged attention, o_proj, + residual, rms_norm, gate/up, SwiGLU, down,
//                     + residual                                      -> the layer's output
//
// Each step calls the very functions the ops call (rms_norm_cpu, linear_cpu or
// quantized_linear_cpu, rope_cpu, paged_attention_cpu, swiglu_cpu) on the same inputs, the
// write copies the same rows as paged_kv_write, and the additions are the same float
// additions, so the output is bit for bit the op-by-op layers': batch invariance and every
// oracle of the op path carry over.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_attention.h"
#include "cpu_layers.h"
#include "cpu_qlinear.h"

namespace tiny_llm {

// One call of a layer's projections that share an input: float32 weights [N_i, K] (bits 0)
// or MLX's affine layout (w_i packed, scales_i, biases_i), `int8` as quantized_linear_cpu.
struct Projections {
  int bits = 0, group = 0;
  bool int8 = false;
  std::vector<const void*> weights, scales, biases;
  std::vector<ScaleType> scale_types;
  std::vector<int64_t> rows;  // N_i
};

// ys[i] [M, N_i] = x [M, K] @ W_i^T, by the kernel the op path would take for decode rows.
void project(const float* x, const Projections& p, const std::vector<float*>& ys, int64_t M,
             int64_t K);

struct DecoderQkvShape {
  int64_t rows, dim;  // T, hidden size
  int n_heads, n_kv_heads, head_dim;
  float eps, qk_eps;
  int rope_dims;
  bool rope_traditional;
  float rope_scale;
};

// q [T, Hq, D], k and v [T, Hkv, D] of the layer's input x [T, dim]. biases (q, k, v) and
// q_norm / k_norm may be null (no attention bias; no per-head norms).
void decoder_qkv_cpu(const float* x, const float* norm_weight, const Projections& proj,
                     const float* const biases[3], const float* q_norm, const float* k_norm,
                     const int32_t* positions, const float* inv_freq, float* q, float* k,
                     float* v, const DecoderQkvShape& shape);

struct DecoderRestShape {
  int64_t rows, dim, intermediate;
  float eps;
  CpuAttentionShape attention;
};

// The layer's output [T, dim] from its input h, its rotated queries q and its pages (the
// step's rows already written).
void decoder_rest_cpu(const float* h, const float* q, const float* k_pages, const float* v_pages,
                      const int32_t* tables, const int32_t* context_lens,
                      const int32_t* query_start_loc, const Projections& o_proj,
                      const float* post_norm, const Projections& gate_up,
                      const Projections& down, float* out, const DecoderRestShape& shape);

// One layer of decoder_layers_cpu: its weights and its pools [P, page_size, Hkv, D].
struct DecoderLayer {
  const float* input_norm;
  Projections qkv;
  const float* qkv_biases[3];   // all null: no attention bias
  const float *q_norm, *k_norm;  // null: no per-head norms
  const float* inv_freq;
  const float* post_norm;
  Projections o_proj, gate_up, down;
};

// The step's rows per layer and where they go: positions, each row's pool slot, and the
// attention's block tables, context lengths and query start locations; and each layer's
// pools [P, page_size, n_kv_heads, head_dim] (layer l's: k_pages[l], v_pages[l]).
struct DecoderStep {
  const int32_t *positions, *slots, *tables, *context_lens, *query_start_loc;
  float *const *k_pages, *const *v_pages;
};

// out [T, dim]: x [T, dim] through the layers in order; each layer's k and v rows are
// written into its pages at `slots` before its attention reads them (the pages change in
// place). qkv.rows, rest.rows and rest.dim are T and dim; rest.intermediate is each
// layer's gate_up rows.
void decoder_layers_cpu(const float* x, const std::vector<DecoderLayer>& layers,
                        const DecoderStep& step, float* out, const DecoderQkvShape& qkv,
                        const DecoderRestShape& rest);

}  // namespace tiny_llm
