// The fused decoder layers' entry points and MLX primitive (see decoder_ops.h).
#include "decoder_ops.h"

#include <array>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_attention.h"
#include "cpu_decoder.h"
#include "linear_ops.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/transforms.h"
#include "op_support.h"

namespace tiny_llm {

namespace {

// The `parts` projections of a layer from weights[first ...] (one array a part for float32
// weights, three for packed ones; evaluated and row-contiguous); `first` moves past them.
Projections read_projections(const std::vector<mx::array>& weights, size_t& first, int parts,
                             int group, int bits, bool int8) {
  Projections p{bits, group, int8 && bits != 0, {}, {}, {}, {}, {}};
  for (int i = 0; i < parts; ++i) {
    const auto& w = weights[first++];
    p.weights.push_back(w.data<void>());
    p.rows.push_back(w.shape(0));
    if (bits) {
      const auto& scales = weights[first++];
      p.scales.push_back(scales.data<void>());
      p.biases.push_back(weights[first++].data<void>());
      p.scale_types.push_back(scale_type(scales.dtype()));
    }
  }
  return p;
}

// The run's layers as decoder_layers_cpu reads them, pointing into its weights.
std::vector<DecoderLayer> read_layers(const DecoderRun& run, bool int8) {
  std::vector<DecoderLayer> layers;
  size_t next = 0;
  auto floats = [&] { return run.weights[next++].data<float>(); };
  for (const DecoderLayerFormat& f : run.formats) {
    DecoderLayer layer{};
    layer.input_norm = floats();
    layer.inv_freq = floats();
    layer.post_norm = floats();
    const auto& [qkv, out_proj, gate_up, down] = f.projections;
    layer.qkv = read_projections(run.weights, next, 3, qkv.first, qkv.second, int8);
    for (auto& b : layer.qkv_biases) b = f.biases ? floats() : nullptr;
    layer.q_norm = f.qk_norms ? floats() : nullptr;
    layer.k_norm = f.qk_norms ? floats() : nullptr;
    layer.o_proj = read_projections(run.weights, next, 1, out_proj.first, out_proj.second, int8);
    layer.gate_up = read_projections(run.weights, next, 2, gate_up.first, gate_up.second, int8);
    layer.down = read_projections(run.weights, next, 1, down.first, down.second, int8);
    layers.push_back(std::move(layer));
  }
  return layers;
}

// Checks one projection argument of the decoder ops and appends its arrays to `inputs`:
// `parts` weight matrices of K columns; returns their rows N_i.
std::vector<int64_t> add_projections(const ProjectionArrays& proj, int parts, int64_t K,
                                     bool int8, std::vector<mx::array>& inputs,
                                     const std::string& what) {
  const auto& [arrays, group, bits] = proj;
  const size_t per_part = bits ? 3 : 1;
  check(arrays.size() == parts * per_part,
        what + " needs " + std::to_string(parts) + " weights (with scales and biases when "
        "quantized)");
  if (bits) {
    check(quantized_kernel_serves({group, bits}) && K % group == 0,
          what + ": the quantized kernel does not serve this format");
    check(!int8 || int8_kernel_serves({group, bits}), what + ": int8 does not serve this format");
  }
  std::vector<int64_t> rows;
  for (int i = 0; i < parts; ++i) {
    const auto& w = arrays[i * per_part];
    if (bits) {
      const auto &sc = arrays[i * per_part + 1], &b = arrays[i * per_part + 2];
      const mx::Shape groups{w.shape(0), static_cast<int>(K / group)};
      check(w.ndim() == 2 && w.dtype() == mx::uint32 && w.shape(1) == K * bits / 32 &&
                sc.shape() == groups && b.shape() == groups && serves_scales(sc, b),
            what + " needs packed uint32 weights [N, K * bits / 32] and scales and biases "
            "[N, K / group] of one dtype: float32, float16 or bfloat16");
    } else {
      check(w.ndim() == 2 && w.dtype() == mx::float32 && w.shape(1) == K,
            what + " needs float32 weights [N, K]");
    }
    rows.push_back(w.shape(0));
  }
  inputs.insert(inputs.end(), arrays.begin(), arrays.end());
  return rows;
}

bool is_vector(const mx::array& a, int64_t n) {
  return a.ndim() == 1 && a.shape(0) == n && a.dtype() == mx::float32;
}

}  // namespace

void DecoderLayers::eval_cpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  auto data = [&](size_t i) { return row_major(inputs[i], enc).data<void>(); };
  const auto* x = static_cast<const float*>(data(0));
  auto ints = [&](size_t i) { return static_cast<const int32_t*>(data(i)); };
  const auto& o = run_->options;
  const size_t pools = 6, L = run_->formats.size();
  // Written in place: decoder_layers() took them row-contiguous, and its caller made sure
  // that nothing else holds them.
  std::vector<float*> k_pages(L), v_pages(L);
  for (size_t l = 0; l < L; ++l) {
    k_pages[l] = const_cast<float*>(inputs[pools + 2 * l].data<float>());
    v_pages[l] = const_cast<float*>(inputs[pools + 2 * l + 1].data<float>());
  }
  const auto &x_in = inputs[0], &k_pool = inputs[pools];
  const DecoderQkvShape qkv_shape{x_in.shape(0), x_in.shape(1), o.n_heads, o.n_kv_heads,
                                  o.head_dim, o.eps, o.qk_eps, o.rope_dims,
                                  o.rope_traditional, o.rope_scale};
  const CpuAttentionShape attention{static_cast<int>(inputs[4].shape(0)),
                                    static_cast<int>(inputs[3].shape(1)), o.n_heads,
                                    o.n_kv_heads, o.head_dim,
                                    static_cast<int>(k_pool.shape(1)), o.scale,
                                    tiled_ ? kCpuQueryTile : 1};
  const DecoderRestShape rest_shape{x_in.shape(0), x_in.shape(1), 0, o.post_eps, attention};
  // The run rides along: its weights live as long as the task that reads them.
  enc.dispatch([x, run = run_, int8 = int8_, k_pages = std::move(k_pages),
                v_pages = std::move(v_pages), meta = std::array{ints(1), ints(2), ints(3),
                                                                ints(4), ints(5)},
                out = outputs[0].data<float>(), qkv_shape, rest_shape]() {
    const DecoderStep step{meta[0], meta[1], meta[2], meta[3], meta[4], k_pages.data(),
                           v_pages.data()};
    decoder_layers_cpu(x, run->layers[int8], step, out, qkv_shape, rest_shape);
  });
}

void DecoderLayers::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DecoderLayers: GPU streams run the model op by op");
}

std::shared_ptr<const DecoderRun> decoder_run(const std::vector<DecoderLayerArrays>& layers,
                                              const DecoderLayersOptions& o) {
  check(!layers.empty(), "decoder_run needs one or more layers");
  const int D = o.head_dim;
  check(o.n_heads > 0 && o.n_kv_heads > 0 && o.n_heads % o.n_kv_heads == 0 && D > 0,
        "decoder_run: n_heads must be a multiple of n_kv_heads, head_dim positive");
  check(o.rope_dims > 0 && o.rope_dims % 2 == 0 && o.rope_dims <= D,
        "decoder_run needs even rope dims <= head_dim");
  DecoderRun run{{}, {}, o, static_cast<int64_t>(std::get<0>(layers[0]).size()), {}};
  const int64_t dim = run.dim;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& [in_norm, qkv, qkv_biases, qk_norms, inv_freq, post_norm, o_proj, gate_up,
                 down] = layers[l];
    const std::string layer = "decoder_run's layer " + std::to_string(l);
    check(is_vector(in_norm, dim) && is_vector(post_norm, dim),
          layer + " needs float32 norm weights [dim], one dim for every layer");
    check(is_vector(inv_freq, o.rope_dims / 2), layer + " needs float32 inv_freq [dims / 2]");
    auto& inputs = run.weights;
    inputs.insert(inputs.end(), {in_norm, inv_freq, post_norm});
    // int8 is each call's: decoder_layers checks that it serves the formats.
    const auto rows = add_projections(qkv, 3, dim, false, inputs, layer + "'s q/k/v");
    check(rows[0] == o.n_heads * D && rows[1] == o.n_kv_heads * D && rows[2] == rows[1],
          layer + ": q [n_heads * D] and k, v [n_kv_heads * D] projections");
    check(qkv_biases.empty() || (qkv_biases.size() == 3 && is_vector(qkv_biases[0], rows[0]) &&
                                 is_vector(qkv_biases[1], rows[1]) &&
                                 is_vector(qkv_biases[2], rows[2])),
          layer + "'s biases: none, or float32 q, k and v biases");
    check(qk_norms.empty() ||
              (qk_norms.size() == 2 && is_vector(qk_norms[0], D) && is_vector(qk_norms[1], D)),
          layer + "'s head norms: none, or float32 q and k norm weights [head_dim]");
    inputs.insert(inputs.end(), qkv_biases.begin(), qkv_biases.end());
    inputs.insert(inputs.end(), qk_norms.begin(), qk_norms.end());
    const auto o_rows = add_projections(o_proj, 1, rows[0], false, inputs, layer + "'s o_proj");
    const auto mlp_rows = add_projections(gate_up, 2, dim, false, inputs, layer + "'s gate/up");
    check(o_rows[0] == dim && mlp_rows[0] == mlp_rows[1],
          layer + ": o_proj [dim, n_heads * D], gate and up of one size");
    const auto down_rows = add_projections(down, 1, mlp_rows[0], false, inputs,
                                           layer + "'s down");
    check(down_rows[0] == dim, layer + ": down [dim, intermediate]");
    auto format = [](const ProjectionArrays& p) {
      return std::pair<int, int>{std::get<1>(p), std::get<2>(p)};
    };
    run.formats.push_back({{format(qkv), format(o_proj), format(gate_up), format(down)},
                           !qkv_biases.empty(), !qk_norms.empty()});
  }
  // Read by the op outside its graph: evaluated now, each row-contiguous.
  mx::eval(run.weights);
  for (auto& w : run.weights)
    if (!w.flags().row_contiguous) w = mx::contiguous(w);
  mx::eval(run.weights);
  for (const bool int8 : {false, true}) run.layers[int8] = read_layers(run, int8);
  return std::make_shared<const DecoderRun>(std::move(run));
}

mx::array decoder_layers(const std::shared_ptr<const DecoderRun>& run_ptr, const mx::array& x,
                         const std::vector<mx::array>& k_pools,
                         const std::vector<mx::array>& v_pools, const mx::array& positions,
                         const mx::array& slot_mapping, const mx::array& block_table,
                         const mx::array& context_lens, const mx::array& query_start_loc,
                         bool tiled, bool int8, mx::StreamOrDevice s) {
  const DecoderRun& run = *run_ptr;
  const auto& o = run.options;
  check(x.ndim() == 2 && x.dtype() == mx::float32 && x.shape(1) == run.dim,
        "decoder_layers needs float32 x [T, dim] of the run's dim");
  const int64_t T = x.shape(0);
  for (const auto& meta : {positions, slot_mapping, context_lens, query_start_loc})
    check(meta.dtype() == mx::int32 && meta.ndim() == 1,
          "positions, slot_mapping, context_lens and query_start_loc must be int32 vectors");
  check(positions.shape(0) == T && slot_mapping.shape(0) == T,
        "decoder_layers needs a position and a slot for each row");
  check(block_table.dtype() == mx::int32 && block_table.ndim() == 2 &&
            block_table.shape(0) == context_lens.shape(0) &&
            query_start_loc.shape(0) == context_lens.shape(0) + 1,
        "decoder_layers needs an int32 block table [B, max_pages] and B + 1 query starts");
  check(k_pools.size() == run.formats.size() && v_pools.size() == run.formats.size(),
        "decoder_layers needs a k and a v pool for each layer of the run");
  std::vector<mx::array> inputs{x, positions, slot_mapping, block_table, context_lens,
                                query_start_loc};
  for (size_t l = 0; l < k_pools.size(); ++l) {
    const auto &k = k_pools[l], &v = v_pools[l];
    check(k.ndim() == 4 && v.shape() == k.shape() && k.shape() == k_pools[0].shape() &&
              k.dtype() == mx::float32 && v.dtype() == mx::float32 &&
              k.shape(2) == o.n_kv_heads && k.shape(3) == o.head_dim && k.is_available() &&
              v.is_available() && k.flags().row_contiguous && v.flags().row_contiguous &&
              k.id() != v.id(),
          "decoder_layers needs evaluated, row-contiguous float32 pools [P, page_size, "
          "n_kv_heads, head_dim], two for each layer");
    inputs.insert(inputs.end(), {k, v});
  }
  if (int8)
    for (const auto& f : run.formats)
      for (const auto& [group, bits] : f.projections)
        check(bits == 0 || int8_kernel_serves({group, bits}),
              "decoder_layers(int8=True): int8 does not serve this format");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "decoder_layers runs on CPU streams only");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<DecoderLayers>(stream, run_ptr, tiled, int8), inputs);
}

}  // namespace tiny_llm
