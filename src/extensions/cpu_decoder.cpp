// A decode step's decoder layers in one call (see cpu_decoder.h).
#include "cpu_decoder.h"

#include <cstring>
#include <vector>

#include "cpu_linear.h"
#include "profile.h"

namespace tiny_llm {

namespace {

// Scratch of the stream's thread, reused from call to call (a few rows of a layer).
float* scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

// y[r, i] += b[i]: the op path's `y + bias` (one float addition per element).
void add_row_bias(float* y, const float* b, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < cols; ++i) y[r * cols + i] += b[i];
}

}  // namespace

void project(const float* x, const Projections& p, const std::vector<float*>& ys, int64_t M,
             int64_t K) {
  if (p.bits == 0) {
    std::vector<LinearPart> parts;
    for (size_t i = 0; i < ys.size(); ++i)
      parts.push_back({static_cast<const float*>(p.weights[i]), ys[i], p.rows[i]});
    linear_cpu(x, parts, M, K);
    return;
  }
  std::vector<QuantizedPart> parts;
  for (size_t i = 0; i < ys.size(); ++i)
    parts.push_back({static_cast<const uint32_t*>(p.weights[i]), p.scales[i], p.biases[i], ys[i],
                     p.rows[i], p.scale_types[i]});
  quantized_linear_cpu(x, parts, M, K, {p.group, p.bits}, p.int8);
}

void decoder_qkv_cpu(const float* x, const float* norm_weight, const Projections& proj,
                     const float* const biases[3], const float* q_norm, const float* k_norm,
                     const int32_t* positions, const float* inv_freq, float* q, float* k,
                     float* v, const DecoderQkvShape& g) {
  ProfileScope profile(Phase::kVectorOps);  // what its kernels' own scopes leave: bias adds
  const int64_t T = g.rows, D = g.head_dim;
  const int64_t nq = g.n_heads * D, nkv = g.n_kv_heads * D;
  float* normed = scratch(T * (g.dim + nq + nkv));
  float* q_raw = normed + T * g.dim;  // before RoPE (rope_cpu does not work in place)
  float* k_raw = q_raw + T * nq;
  rms_norm_cpu(x, norm_weight, normed, T, g.dim, g.eps);
  project(normed, proj, {q_raw, k_raw, v}, T, g.dim);
  if (biases[0]) {
    add_row_bias(q_raw, biases[0], T, nq);
    add_row_bias(k_raw, biases[1], T, nkv);
    add_row_bias(v, biases[2], T, nkv);
  }
  if (q_norm) {  // each head's row normalised on its own (rms_norm_cpu may work in place)
    rms_norm_cpu(q_raw, q_norm, q_raw, T * g.n_heads, D, g.qk_eps);
    rms_norm_cpu(k_raw, k_norm, k_raw, T * g.n_kv_heads, D, g.qk_eps);
  }
  rope_cpu(q_raw, positions, inv_freq, q,
           {T, g.n_heads, D, g.rope_dims, g.rope_traditional, g.rope_scale});
  rope_cpu(k_raw, positions, inv_freq, k,
           {T, g.n_kv_heads, D, g.rope_dims, g.rope_traditional, g.rope_scale});
}

void decoder_rest_cpu(const float* h, const float* q, const float* k_pages, const float* v_pages,
                      const int32_t* tables, const int32_t* context_lens,
                      const int32_t* query_start_loc, const Projections& o_proj,
                      const float* post_norm, const Projections& gate_up,
                      const Projections& down, float* out, const DecoderRestShape& g) {
  ProfileScope profile(Phase::kVectorOps);  // what its kernels' own scopes leave: residuals
  const int64_t T = g.rows, dim = g.dim, inter = g.intermediate;
  const int64_t nq = static_cast<int64_t>(g.attention.n_heads) * g.attention.head_dim;
  float* attn = scratch(T * (nq + 2 * dim + 2 * inter));
  float* proj_out = attn + T * nq;  // o_proj's, then down's
  float* normed = proj_out + T * dim;
  float* gate = normed + T * dim;
  float* up = gate + T * inter;
  paged_attention_cpu<float>(q, k_pages, v_pages, tables, context_lens, query_start_loc, attn,
                             g.attention);
  project(attn, o_proj, {proj_out}, T, nq);
  for (int64_t i = 0; i < T * dim; ++i) out[i] = h[i] + proj_out[i];  // h + attention
  rms_norm_cpu(out, post_norm, normed, T, dim, g.eps);
  project(normed, gate_up, {gate, up}, T, dim);
  swiglu_cpu(gate, up, gate, T, inter);  // elementwise: in place is safe
  project(gate, down, {proj_out}, T, inter);
  for (int64_t i = 0; i < T * dim; ++i) out[i] += proj_out[i];  // + the MLP
}

void decoder_layers_cpu(const float* x, const std::vector<DecoderLayer>& layers,
                        const DecoderStep& step, float* out, const DecoderQkvShape& qkv,
                        const DecoderRestShape& rest) {
  const int64_t T = qkv.rows, D = qkv.head_dim;
  const int64_t nq = qkv.n_heads * D, nkv = qkv.n_kv_heads * D;
  // Not scratch(): decoder_qkv_cpu and decoder_rest_cpu use it for their own rows.
  std::vector<float> rows(T * (nq + 2 * nkv));
  float *q = rows.data(), *k = q + T * nq, *v = k + T * nkv;
  std::memcpy(out, x, sizeof(float) * T * qkv.dim);
  for (size_t l = 0; l < layers.size(); ++l) {
    const DecoderLayer& layer = layers[l];
    float *k_pages = step.k_pages[l], *v_pages = step.v_pages[l];
    // The layer reads its input from `out` and writes its output there: decoder_rest_cpu
    // reads each element of h before it writes that element of out.
    decoder_qkv_cpu(out, layer.input_norm, layer.qkv, layer.qkv_biases, layer.q_norm,
                    layer.k_norm, step.positions, layer.inv_freq, q, k, v, qkv);
    {
      ProfileScope profile(Phase::kKvWrite);
      for (int64_t t = 0; t < T; ++t) {  // paged_kv_write's copies: row t to its slot
        std::memcpy(k_pages + step.slots[t] * nkv, k + t * nkv, sizeof(float) * nkv);
        std::memcpy(v_pages + step.slots[t] * nkv, v + t * nkv, sizeof(float) * nkv);
      }
    }
    DecoderRestShape shape = rest;
    shape.intermediate = layer.gate_up.rows[0];
    decoder_rest_cpu(out, q, k_pages, v_pages, step.tables, step.context_lens,
                     step.query_start_loc, layer.o_proj, layer.post_norm, layer.gate_up,
                     layer.down, out, shape);
  }
}

}  // namespace tiny_llm
