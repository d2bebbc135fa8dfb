// The paged ops' entry points and MLX primitives (see paged_ops.h). The primitives'
// eval_cpu runs the C++ schedules (cpu_attention.cpp); GPU streams go through MLX's Metal
// JIT with the launch plan of metal_launch.cpp instead.
#include "paged_ops.h"

#include <atomic>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include "cpu_attention.h"
#include "metal_launch.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "op_support.h"

namespace tiny_llm {

namespace {

std::atomic<int> g_pool_copies{0};

// ANCHOR: cpu_dispatch
template <typename T>
void dispatch_attention(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& in,
                        mx::array& out, const CpuAttentionShape& g) {
  // Inputs 6 and 7, where given: the rows of a token tree (tree_start, tree_mask).
  const CpuTreeRows tree = in.size() == 8
                               ? CpuTreeRows{in[6].data<int32_t>(), in[7].data<uint64_t>()}
                               : CpuTreeRows{nullptr, nullptr};
  enc.dispatch([q = in[0].data<T>(), k = in[1].data<T>(), v = in[2].data<T>(),
                table = in[3].data<int32_t>(), ctx = in[4].data<int32_t>(),
                qsl = in[5].data<int32_t>(), o = out.data<T>(), g, tree]() {
    paged_attention_cpu<T>(q, k, v, table, ctx, qsl, o, g, tree.start ? &tree : nullptr);
  });
}
// ANCHOR_END: cpu_dispatch

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

// ANCHOR: op_entry
mx::array paged_attention(const mx::array& q, const mx::array& k_pages,
                          const mx::array& v_pages, const mx::array& block_table,
                          const mx::array& context_lens, const mx::array& query_start_loc,
                          float scale, bool tiled, bool gpu_rehearsal,
                          const std::optional<mx::array>& tree_start,
                          const std::optional<mx::array>& tree_mask, mx::StreamOrDevice s) {
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
  check(tree_start.has_value() == tree_mask.has_value(),
        "tree_start and tree_mask go together: give both or neither");
  if (tree_start) {
    check(tree_start->dtype() == mx::int32 && tree_mask->dtype() == mx::uint64 &&
              tree_start->ndim() == 1 && tree_start->shape(0) == q.shape(0) &&
              tree_mask->shape() == tree_start->shape(),
          "tree_start must be int32 [T] and tree_mask uint64 [T]");
  }
  auto stream = mx::to_stream(s);
  if (q.shape(0) == 0) return mx::zeros(q.shape(), q.dtype(), stream);
  if (stream.device == mx::Device::gpu || gpu_rehearsal) {
    // The rehearsal makes (and checks) the launch plan a GPU would run, then runs the CPU's.
    auto plan = plan_paged_attention(q, k_pages, v_pages, block_table, context_lens,
                                     query_start_loc, scale, tiled, tree_start, tree_mask,
                                     stream);
    if (stream.device == mx::Device::gpu) return launch_metal(plan, stream)[0];
  }
  std::vector<mx::array> inputs{q, k_pages, v_pages, block_table, context_lens, query_start_loc};
  if (tree_start) inputs.insert(inputs.end(), {*tree_start, *tree_mask});
  return mx::array(q.shape(), q.dtype(), std::make_shared<PagedAttention>(stream, scale, tiled),
                   std::move(inputs));
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

}  // namespace tiny_llm
