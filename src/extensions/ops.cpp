// Op entry points and MLX primitives of the paged ops (see ops.h). The primitives'
// eval_cpu runs the C++ schedules (cpu_attention.cpp); GPU streams go through MLX's Metal
// JIT with the launch plan of metal_launch.cpp instead.
#include "ops.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_attention.h"
#include "cpu_decoder.h"
#include "cpu_linear.h"
#include "cpu_qlinear.h"
#include "cpu_layers.h"
#include "metal_launch.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace tiny_llm {

namespace {

std::atomic<int> g_pool_copies{0};

// ANCHOR: cpu_dispatch
template <typename T>
void dispatch_attention(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& in,
                        mx::array& out, const CpuAttentionShape& g) {
  enc.dispatch([q = in[0].data<T>(), k = in[1].data<T>(), v = in[2].data<T>(),
                table = in[3].data<int32_t>(), ctx = in[4].data<int32_t>(),
                qsl = in[5].data<int32_t>(), o = out.data<T>(), g]() {
    paged_attention_cpu<T>(q, k, v, table, ctx, qsl, o, g);
  });
}
// ANCHOR_END: cpu_dispatch

// Row-major copy of a strided array (element strides), one element at a time.
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

// `a` itself when it is row-major, else a row-major copy made on the stream (a temporary
// of the encoder: it lives until the kernel that reads it has run).
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

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("tiny_llm paged ops: " + message);
}

// The CPU schedules' view of q [T, Hq, D], the pages [P, page_size, Hkv, D] and the
// metadata.
CpuAttentionShape attention_shape(const mx::array& q, const mx::array& k_pages,
                                  const mx::array& block_table, const mx::array& context_lens,
                                  float scale, bool tiled) {
  return {static_cast<int>(context_lens.shape(0)), static_cast<int>(block_table.shape(1)),
          static_cast<int>(q.shape(1)),            static_cast<int>(k_pages.shape(2)),
          static_cast<int>(q.shape(2)),            static_cast<int>(k_pages.shape(1)),
          scale,                                   tiled ? kCpuQueryTile : 1};
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// Quantized layers' scales and biases: of one float dtype, read as stored (cpu_qlinear.h).
bool serves_scales(const mx::array& scales, const mx::array& biases) {
  return is_float(scales.dtype()) && biases.dtype() == scales.dtype();
}

ScaleType scale_type(mx::Dtype t) {
  return t == mx::float16 ? ScaleType::f16 : t == mx::bfloat16 ? ScaleType::bf16 : ScaleType::f32;
}

}  // namespace

int pool_copies() { return g_pool_copies.load(); }

// ANCHOR: cpu_eval
void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  // The kernels index plain row-major arrays; a strided input is copied here (a copy
  // node in the graph for every input would cost a scheduled op even when none is needed).
  std::vector<mx::array> in;
  for (const auto& a : inputs) in.push_back(row_major(a, enc));
  const auto& q = in[0];
  const CpuAttentionShape g = attention_shape(q, in[1], in[3], in[4], scale_, tiled_);
  switch (q.dtype()) {
    case mx::float32: return dispatch_attention<float>(enc, in, out, g);
    case mx::float16: return dispatch_attention<mx::float16_t>(enc, in, out, g);
    case mx::bfloat16: return dispatch_attention<mx::bfloat16_t>(enc, in, out, g);
    default: throw std::invalid_argument("paged_attention: unsupported dtype");
  }
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // GPU streams never build this primitive: paged_attention() routes them to the Metal
  // kernels compiled by MLX's fast::metal_kernel (metal_launch.cpp).
  throw std::runtime_error("PagedAttention: GPU streams use the JIT Metal kernel");
}
// ANCHOR_END: cpu_eval

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return scale_ == o.scale_ && tiled_ == o.tiled_;
}

// ANCHOR: cpu_kv_write
// One pool per primitive: a multi-output primitive would hold the pools in each sibling's
// input list, and an input held twice is never donatable.
void PagedKVWrite::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const auto& pool = inputs[0];
  auto& out = outputs[0];
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  if (pool.is_donatable() && pool.flags().row_contiguous) {
    out.copy_shared_buffer(pool);  // in place: the output *is* the pool's buffer
  } else {
    // Someone else still holds the pool (writing in place would change their array), or
    // it is a strided view: copy it into a fresh row-contiguous buffer first.
    g_pool_copies.fetch_add(1);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    enc.dispatch([src = pool.data<char>(), dst = out.data<char>(), shape = pool.shape(),
                  strides = pool.strides(), item = pool.itemsize(),
                  contiguous = pool.flags().row_contiguous, n = out.nbytes()]() {
      if (contiguous) {
        std::memcpy(dst, src, n);
      } else {
        copy_strided(src, dst, shape, strides, item);
      }
    });
  }
  const auto rows = row_major(inputs[1], enc);
  const auto slots = row_major(inputs[2], enc);
  // TASK 4.3: PagedKVWrite::eval_cpu, the row copies — Writing in place
  const int64_t row_bytes = rows.nbytes() / std::max<int64_t>(1, rows.shape(0));
  enc.dispatch([dst = out.data<char>(), src = rows.data<char>(),
                slots = slots.data<int32_t>(), n = rows.shape(0), row_bytes]() {
    for (int64_t t = 0; t < n; ++t)
      std::memcpy(dst + slots[t] * row_bytes, src + t * row_bytes, row_bytes);
  });
  // END TASK
}
// ANCHOR_END: cpu_kv_write

void PagedKVWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("PagedKVWrite: GPU streams use MLX's scatter with buffer donation");
}

namespace {

// The start of every eval_cpu below, as PagedAttention::eval_cpu spells it out: allocate
// the outputs now, hand the arrays to the stream's encoder, and return the encoder.
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

}  // namespace

// ANCHOR: cpu_linear_eval
void Linear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  const auto x = row_major(inputs[0], enc);
  std::vector<LinearPart> parts;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto w = row_major(inputs[i + 1], enc);
    parts.push_back({w.data<float>(), outputs[i].data<float>(), w.shape(0)});
  }
  enc.dispatch([x = x.data<float>(), parts = std::move(parts), m = x.shape(0), k = x.shape(1),
                blas = blas_]() {
    if (blas) {
      linear_blas_split(x, parts, m, k);
    } else {
      linear_cpu(x, parts, m, k);
    }
  });
}
// ANCHOR_END: cpu_linear_eval

void Linear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("Linear: GPU streams use MLX's matmul (tiny_llm/cpu_kernels.py)");
}

void QuantizedLinear::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  const auto x = row_major(inputs[0], enc);
  std::vector<QuantizedPart> parts;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto w = row_major(inputs[3 * i + 1], enc);
    const auto scales = row_major(inputs[3 * i + 2], enc);
    const auto biases = row_major(inputs[3 * i + 3], enc);
    parts.push_back({w.data<uint32_t>(), scales.data<void>(), biases.data<void>(),
                     outputs[i].data<float>(), w.shape(0), scale_type(scales.dtype())});
  }
  enc.dispatch([x = x.data<float>(), parts = std::move(parts), m = x.shape(0), k = x.shape(1),
                format = QuantFormat{group_, bits_}, blas = blas_, int8 = int8_]() {
    if (blas) {
      quantized_linear_blas_split(x, parts, m, k, format);
    } else {
      quantized_linear_cpu(x, parts, m, k, format, int8);
    }
  });
}

void QuantizedLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "QuantizedLinear: GPU streams use MLX's quantized_matmul (tiny_llm/cpu_kernels.py)");
}

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
  throw std::runtime_error("Rope: GPU streams use mx.fast.rope (tiny_llm/model.py)");
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
  throw std::runtime_error("SwiGLU: GPU streams use MLX's ops (tiny_llm/model.py)");
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
  throw std::runtime_error("RmsNorm: GPU streams use mx.fast.rms_norm (tiny_llm/cpu_kernels.py)");
}

namespace {

// The `parts` projections of a decoder op from inputs[first ...] (one array a part for
// float32 weights, three for packed ones); `first` moves past them.
Projections read_projections(const std::vector<mx::array>& inputs, size_t& first, int parts,
                             int group, int bits, bool int8, mx::cpu::CommandEncoder& enc) {
  Projections p{bits, group, int8 && bits != 0, {}, {}, {}, {}, {}};
  for (int i = 0; i < parts; ++i) {
    const auto w = row_major(inputs[first++], enc);
    p.weights.push_back(w.data<void>());
    p.rows.push_back(w.shape(0));
    if (bits) {
      const auto scales = row_major(inputs[first++], enc);
      p.scales.push_back(scales.data<void>());
      p.biases.push_back(row_major(inputs[first++], enc).data<void>());
      p.scale_types.push_back(scale_type(scales.dtype()));
    }
  }
  return p;
}

}  // namespace

void DecoderLayers::eval_cpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  auto& enc = begin_cpu_eval(stream(), inputs, outputs);
  auto data = [&](size_t i) { return row_major(inputs[i], enc).data<void>(); };
  const auto* x = static_cast<const float*>(data(0));
  auto ints = [&](size_t i) { return static_cast<const int32_t*>(data(i)); };
  const DecoderStep step{ints(1), ints(2), ints(3), ints(4), ints(5)};
  const auto& o = options_;
  const size_t pools = 6, L = formats_.size();
  std::vector<DecoderLayer> layers;
  size_t next = pools + 2 * L;
  for (size_t l = 0; l < L; ++l) {
    const DecoderLayerFormat& f = formats_[l];
    DecoderLayer layer{};
    // Written in place: decoder_layers() took them row-contiguous, and its caller made
    // sure that nothing else holds them.
    layer.k_pages = const_cast<float*>(inputs[pools + 2 * l].data<float>());
    layer.v_pages = const_cast<float*>(inputs[pools + 2 * l + 1].data<float>());
    auto floats = [&] { return static_cast<const float*>(data(next++)); };
    layer.input_norm = floats();
    layer.inv_freq = floats();
    layer.post_norm = floats();
    const auto& [qkv, out_proj, gate_up, down] = f.projections;
    layer.qkv = read_projections(inputs, next, 3, qkv.first, qkv.second, int8_, enc);
    for (auto& b : layer.qkv_biases) b = f.biases ? floats() : nullptr;
    layer.q_norm = f.qk_norms ? floats() : nullptr;
    layer.k_norm = f.qk_norms ? floats() : nullptr;
    layer.o_proj = read_projections(inputs, next, 1, out_proj.first, out_proj.second, int8_, enc);
    layer.gate_up = read_projections(inputs, next, 2, gate_up.first, gate_up.second, int8_, enc);
    layer.down = read_projections(inputs, next, 1, down.first, down.second, int8_, enc);
    layers.push_back(std::move(layer));
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
  enc.dispatch([x, layers = std::move(layers), step, out = outputs[0].data<float>(), qkv_shape,
                rest_shape]() {
    decoder_layers_cpu(x, layers, step, out, qkv_shape, rest_shape);
  });
}

void DecoderLayers::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("DecoderLayers: GPU streams run the model op by op");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
}

// ANCHOR: op_entry
mx::array paged_attention(const mx::array& q, const mx::array& k_pages,
                          const mx::array& v_pages, const mx::array& block_table,
                          const mx::array& context_lens, const mx::array& query_start_loc,
                          float scale, bool tiled, bool gpu_rehearsal,
                          mx::StreamOrDevice s) {
  check(q.ndim() == 3 && k_pages.ndim() == 4 && v_pages.shape() == k_pages.shape(),
        "q must be [T, Hq, D] and pages [P, page_size, Hkv, D]");
  check(is_float(q.dtype()) && k_pages.dtype() == q.dtype() && v_pages.dtype() == q.dtype(),
        "q and pages must share one float dtype");
  check(q.shape(2) == k_pages.shape(3) && k_pages.shape(2) > 0 &&
            q.shape(1) % k_pages.shape(2) == 0,
        "q [T, Hq, D] must match the pages' head_dim, with Hq a multiple of their KV heads");
  check(block_table.dtype() == mx::int32 && context_lens.dtype() == mx::int32 &&
            query_start_loc.dtype() == mx::int32,
        "block_table, context_lens and query_start_loc must be int32");
  auto stream = mx::to_stream(s);
  if (q.shape(0) == 0) return mx::zeros(q.shape(), q.dtype(), stream);
  if (stream.device == mx::Device::gpu || gpu_rehearsal) {
    // The rehearsal makes (and checks) the launch plan a GPU would run, then runs the CPU's.
    auto plan = plan_paged_attention(q, k_pages, v_pages, block_table, context_lens,
                                     query_start_loc, scale, tiled, stream);
    if (stream.device == mx::Device::gpu) return launch_metal(plan, stream)[0];
  }
  return mx::array(q.shape(), q.dtype(), std::make_shared<PagedAttention>(stream, scale, tiled),
                   {q, k_pages, v_pages, block_table, context_lens, query_start_loc});
}

std::tuple<mx::array, mx::array> paged_kv_write(const mx::array& k_pages,
                                                const mx::array& v_pages,
                                                const mx::array& k_new, const mx::array& v_new,
                                                const mx::array& slot_mapping,
                                                bool gpu_rehearsal, mx::StreamOrDevice s) {
  check(k_pages.ndim() == 4 && v_pages.shape() == k_pages.shape(),
        "pages must be [P, page_size, Hkv, D]");
  check(k_new.ndim() == 3 && v_new.shape() == k_new.shape() &&
            k_new.shape(1) == k_pages.shape(2) && k_new.shape(2) == k_pages.shape(3),
        "new rows must be [T, Hkv, D] matching the pages");
  check(k_new.dtype() == k_pages.dtype() && v_new.dtype() == v_pages.dtype() &&
            v_pages.dtype() == k_pages.dtype(),
        "pools and new rows must share one dtype");
  check(slot_mapping.dtype() == mx::int32 && slot_mapping.ndim() == 1 &&
            slot_mapping.shape(0) == k_new.shape(0),
        "slot_mapping must be int32 [T]");
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::gpu || gpu_rehearsal) {
    // MLX's scatter donates the pool's buffer when nothing else holds it: O(new rows).
    const auto shape = k_pages.shape();
    const int rows = shape[0] * shape[1];
    auto write = [&](const mx::array& pages, const mx::array& rows_new) {
      auto flat = mx::reshape(pages, {rows, shape[2], shape[3]}, stream);
      auto upd = mx::expand_dims(rows_new, 1, stream);
      return mx::reshape(mx::scatter(flat, slot_mapping, upd, 0, stream), shape, stream);
    };
    return {write(k_pages, k_new), write(v_pages, v_new)};
  }
  auto write = [&](const mx::array& pages, const mx::array& rows_new) {
    return mx::array(pages.shape(), pages.dtype(), std::make_shared<PagedKVWrite>(stream),
                     {pages, rows_new, slot_mapping});
  };
  return {write(k_pages, k_new), write(v_pages, v_new)};
}
// ANCHOR_END: op_entry

std::vector<mx::array> linear(const mx::array& x, const std::vector<mx::array>& weights,
                              bool blas, mx::StreamOrDevice s) {
  check(!weights.empty(), "linear needs one or more weights");
  check(x.ndim() == 2, "linear needs x [M, K] and w [N, K]");
  std::vector<mx::Shape> shapes;
  for (const auto& w : weights) {
    check(w.ndim() == 2 && w.shape(1) == x.shape(1), "linear needs x [M, K] and w [N, K]");
    check(w.dtype() == mx::float32, "linear computes in float32");
    shapes.push_back({x.shape(0), w.shape(0)});
  }
  check(x.dtype() == mx::float32, "linear computes in float32");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "linear runs on CPU streams only");
  check(!blas || kHasBlasSplit, "linear(blas=True) runs on Linux only");
  // Strided inputs are copied by the primitive itself: no extra graph nodes per call.
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  return mx::array::make_arrays(std::move(shapes),
                                std::vector<mx::Dtype>(weights.size(), mx::float32),
                                std::make_shared<Linear>(stream, blas), inputs);
}

std::vector<mx::array> quantized_linear(const mx::array& x,
                                        const std::vector<mx::array>& weights,
                                        const std::vector<mx::array>& scales,
                                        const std::vector<mx::array>& biases, int group,
                                        int bits, bool blas, bool int8, mx::StreamOrDevice s) {
  check(!weights.empty() && scales.size() == weights.size() && biases.size() == weights.size(),
        "quantized_linear needs one or more weights, each with its scales and biases");
  check(quantized_kernel_serves({group, bits}),
        "quantized_linear serves 4 and 8 bits in groups of a multiple of 32");
  check(x.ndim() == 2 && x.dtype() == mx::float32, "quantized_linear needs float32 x [M, K]");
  const int64_t K = x.shape(1);
  check(K % group == 0, "quantized_linear needs K a multiple of the group size");
  std::vector<mx::Shape> shapes;
  std::vector<mx::array> inputs{x};
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto &w = weights[i], &sc = scales[i], &b = biases[i];
    check(w.ndim() == 2 && w.dtype() == mx::uint32 && w.shape(1) == K * bits / 32,
          "quantized_linear needs packed uint32 weights [N, K * bits / 32]");
    const mx::Shape groups{w.shape(0), static_cast<int>(K / group)};
    check(sc.shape() == groups && b.shape() == groups && serves_scales(sc, b),
          "quantized_linear needs scales and biases [N, K / group] of one dtype: float32, "
          "float16 or bfloat16");
    shapes.push_back({x.shape(0), w.shape(0)});
    inputs.insert(inputs.end(), {w, sc, b});
  }
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "quantized_linear runs on CPU streams only");
  check(!blas || kHasBlasSplit, "quantized_linear(blas=True) runs on Linux only");
  check(!(blas && int8), "quantized_linear: int8 rows are decode rows, not blas=True ones");
  check(!int8 || int8_kernel_serves({group, bits}),
        "quantized_linear(int8=True) serves groups that divide 64 bytes of packed weights or "
        "are a multiple of them (32, 64 or 128 at 4 bits)");
  return mx::array::make_arrays(std::move(shapes),
                                std::vector<mx::Dtype>(weights.size(), mx::float32),
                                std::make_shared<QuantizedLinear>(stream, group, bits, blas, int8),
                                inputs);
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

namespace {

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

DecoderRun decoder_run(const std::vector<DecoderLayerArrays>& layers,
                       const DecoderLayersOptions& o) {
  check(!layers.empty(), "decoder_run needs one or more layers");
  const int D = o.head_dim;
  check(o.n_heads > 0 && o.n_kv_heads > 0 && o.n_heads % o.n_kv_heads == 0 && D > 0,
        "decoder_run: n_heads must be a multiple of n_kv_heads, head_dim positive");
  check(o.rope_dims > 0 && o.rope_dims % 2 == 0 && o.rope_dims <= D,
        "decoder_run needs even rope dims <= head_dim");
  DecoderRun run{{}, {}, o, static_cast<int64_t>(std::get<0>(layers[0]).size())};
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
  return run;
}

mx::array decoder_layers(const DecoderRun& run, const mx::array& x,
                         const std::vector<mx::array>& k_pools,
                         const std::vector<mx::array>& v_pools, const mx::array& positions,
                         const mx::array& slot_mapping, const mx::array& block_table,
                         const mx::array& context_lens, const mx::array& query_start_loc,
                         bool tiled, bool int8, mx::StreamOrDevice s) {
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
  inputs.insert(inputs.end(), run.weights.begin(), run.weights.end());
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<DecoderLayers>(stream, o, run.formats, tiled, int8), inputs);
}

}  // namespace tiny_llm
