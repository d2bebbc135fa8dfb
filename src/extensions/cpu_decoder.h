// A decoder layer of a decode step in two calls on the CPU (tiny_llm/cpu_fused.py).
//
// Op by op, one layer of a decode step is about sixteen MLX ops (two norms, the
// projections, RoPE, the K/V write, attention, SwiGLU, two residual additions, reshapes),
// each built by Python and scheduled by MLX: for a one-row step of a small model those
// costs add up to a third of the step. Here the layer is two ops around the K/V write:
//
//   decoder_qkv:  rms_norm, the q/k/v projections (+ their biases), the per-head q/k norms,
//                 RoPE                                          -> q, k, v
//   (paged_kv_write of k and v, in place, as op by op)
//   decoder_rest: paged attention, o_proj, + residual, rms_norm, gate/up, SwiGLU, down,
//                 + residual                                     -> the layer's output
//
// Each step calls the very functions the ops call (rms_norm_cpu, linear_cpu or
// quantized_linear_cpu, rope_cpu, paged_attention_cpu, swiglu_cpu) on the same inputs, and
// the additions are the same float additions, so the output is bit for bit the op-by-op
// layer's: batch invariance and every oracle of the op path carry over.
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

}  // namespace tiny_llm
