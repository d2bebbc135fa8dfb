// CPU kernels and op entry points for paged attention (see paged_attention.h).
//
// CPU schedule (Day 4, the vector schedule): one work item per (query row, KV head).
// The item walks its sequence's block table page by page up to the row's causal limit
// and keeps an online softmax (running max m, running sum l, running output acc) for
// the G query heads that share the KV head, so every K and V row is read once for the
// whole group. Items run in parallel on the machine's threads.
//
// GPU: the same schedule as a Metal kernel (metal/paged_attention.metal), compiled at
// run time by MLX (fast::metal_kernel), so no Metal toolchain is needed to build.
#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

namespace tiny_llm {

namespace {

std::atomic<int> g_pool_copies{0};
std::atomic<int> g_num_threads{0};

// Runs fn(0..n-1) on up to the machine's threads; spawning costs tens of microseconds,
// so small jobs stay on the calling thread.
void parallel_for(int n, double flops_per_item, const std::function<void(int)>& fn) {
  int hw = g_num_threads.load();
  if (hw <= 0) hw = std::max(1u, std::thread::hardware_concurrency());
  const double total = n * flops_per_item;
  int threads = std::min({hw, n, std::max(1, static_cast<int>(total / 2e5))});
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

struct Geometry {
  int num_seqs, max_pages, n_heads, n_kv_heads, head_dim, page_size;
  float scale;
};

// ANCHOR: cpu_vector_schedule
// One query row against `num_keys` keys of one sequence, for the G query heads that
// share KV head `kv_head`. q and out point at the group's first head.
template <typename T>
void attend_row(const T* q, const T* k_pages, const T* v_pages, const int32_t* table,
                int num_keys, int kv_head, const Geometry& g, T* out) {
  const int G = g.n_heads / g.n_kv_heads, D = g.head_dim, ps = g.page_size;
  thread_local std::vector<float> buf;
  buf.assign(2 * G * D + 2 * G + G * ps, 0.0f);
  float* qf = buf.data();
  float* acc = qf + G * D;
  float* m = acc + G * D;
  float* l = m + G;
  float* s = l + G;  // [G, ps]: scores, then probabilities, of the current page
  for (int x = 0; x < G * D; ++x) qf[x] = static_cast<float>(q[x]) * g.scale;
  std::fill(m, m + G, -FLT_MAX);
  const int64_t slot_stride = static_cast<int64_t>(g.n_kv_heads) * D;
  for (int start = 0, j = 0; start < num_keys; start += ps, ++j) {
    const int n = std::min(ps, num_keys - start);
    // Address translation: logical page j of this sequence lives in physical page table[j].
    const int64_t base = static_cast<int64_t>(table[j]) * ps * slot_stride + kv_head * D;
    for (int t = 0; t < n; ++t) {
      const T* krow = k_pages + base + t * slot_stride;
      for (int gi = 0; gi < G; ++gi) {
        const float* qg = qf + gi * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(krow[d]);
        s[gi * ps + t] = dot;
      }
    }
    // Online softmax, once per page: rescale what was accumulated to the new max.
    for (int gi = 0; gi < G; ++gi) {
      float* sg = s + gi * ps;
      const float page_max = *std::max_element(sg, sg + n);
      const float new_m = std::max(m[gi], page_max);
      const float correction = std::exp(m[gi] - new_m);
      l[gi] *= correction;
      for (int d = 0; d < D; ++d) acc[gi * D + d] *= correction;
      m[gi] = new_m;
      for (int t = 0; t < n; ++t) {
        sg[t] = std::exp(sg[t] - new_m);
        l[gi] += sg[t];
      }
    }
    for (int t = 0; t < n; ++t) {
      const T* vrow = v_pages + base + t * slot_stride;
      for (int gi = 0; gi < G; ++gi) {
        const float p = s[gi * ps + t];
        float* a = acc + gi * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] += p * static_cast<float>(vrow[d]);
      }
    }
  }
  for (int gi = 0; gi < G; ++gi)
    for (int d = 0; d < D; ++d) out[gi * D + d] = static_cast<T>(acc[gi * D + d] / l[gi]);
}

template <typename T>
void paged_attention_cpu(const T* q, const T* k_pages, const T* v_pages, const int32_t* tables,
                         const int32_t* context_lens, const int32_t* qsl, T* out,
                         Geometry g) {
  const int total_rows = qsl[g.num_seqs];
  // Row r belongs to sequence seq_of[r]; its absolute position sets its causal limit.
  std::vector<int> seq_of(total_rows);
  for (int b = 0; b < g.num_seqs; ++b)
    for (int r = qsl[b]; r < qsl[b + 1]; ++r) seq_of[r] = b;
  const int G = g.n_heads / g.n_kv_heads;
  const int64_t row_elems = static_cast<int64_t>(g.n_heads) * g.head_dim;
  double keys = 0;
  for (int b = 0; b < g.num_seqs; ++b) keys += double(context_lens[b]) * (qsl[b + 1] - qsl[b]);
  const double flops = 4.0 * G * g.head_dim * keys / std::max(1, total_rows);
  parallel_for(total_rows * g.n_kv_heads, flops, [&](int item) {
    const int r = item / g.n_kv_heads, h = item % g.n_kv_heads, b = seq_of[r];
    const int query_len = qsl[b + 1] - qsl[b];
    const int num_keys = context_lens[b] - query_len + (r - qsl[b]) + 1;  // causal
    const int64_t offset = r * row_elems + static_cast<int64_t>(h) * G * g.head_dim;
    attend_row(q + offset, k_pages, v_pages, tables + static_cast<int64_t>(b) * g.max_pages,
               num_keys, h, g, out + offset);
  });
}
// ANCHOR_END: cpu_vector_schedule

template <typename T>
void dispatch_attention(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& in,
                        mx::array& out, const Geometry& g) {
  enc.dispatch([q = in[0].data<T>(), k = in[1].data<T>(), v = in[2].data<T>(),
                table = in[3].data<int32_t>(), ctx = in[4].data<int32_t>(),
                qsl = in[5].data<int32_t>(), o = out.data<T>(), g]() {
    paged_attention_cpu<T>(q, k, v, table, ctx, qsl, o, g);
  });
}

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("tiny_llm paged ops: " + message);
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

}  // namespace

int pool_copies() { return g_pool_copies.load(); }

void set_num_threads(int n) { g_num_threads.store(n); }

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  Geometry g{static_cast<int>(inputs[4].shape(0)), static_cast<int>(inputs[3].shape(1)),
             static_cast<int>(q.shape(1)), static_cast<int>(k.shape(2)),
             static_cast<int>(q.shape(2)), static_cast<int>(k.shape(1)), scale_};
  switch (q.dtype()) {
    case mx::float32: return dispatch_attention<float>(enc, inputs, out, g);
    case mx::float16: return dispatch_attention<mx::float16_t>(enc, inputs, out, g);
    case mx::bfloat16: return dispatch_attention<mx::bfloat16_t>(enc, inputs, out, g);
    default: throw std::invalid_argument("paged_attention: unsupported dtype");
  }
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // GPU streams never build this primitive: paged_attention() routes them to the Metal
  // kernel compiled by MLX's fast::metal_kernel (see paged_attention_metal below).
  throw std::runtime_error("PagedAttention: GPU streams use the JIT Metal kernel");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  return scale_ == static_cast<const PagedAttention&>(other).scale_;
}

// ANCHOR: cpu_kv_write
void PagedKVWrite::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  for (int i = 0; i < 2; ++i) {
    const auto& pool = inputs[i];
    auto& out = outputs[i];
    enc.set_output_array(out);
    if (pool.is_donatable()) {
      out.copy_shared_buffer(pool);  // in place: the output *is* the pool's buffer
    } else {
      // Someone else still holds the pool: writing in place would change their array.
      g_pool_copies.fetch_add(1);
      out.set_data(mx::allocator::malloc(out.nbytes()));
      enc.dispatch([src = pool.data<char>(), dst = out.data<char>(), n = out.nbytes()]() {
        std::memcpy(dst, src, n);
      });
    }
  }
  const auto& k_new = inputs[2];
  const int64_t row_bytes = k_new.nbytes() / std::max<int64_t>(1, k_new.shape(0));
  enc.dispatch([k = outputs[0].data<char>(), v = outputs[1].data<char>(),
                kn = inputs[2].data<char>(), vn = inputs[3].data<char>(),
                slots = inputs[4].data<int32_t>(), rows = k_new.shape(0), row_bytes]() {
    for (int64_t t = 0; t < rows; ++t) {
      std::memcpy(k + slots[t] * row_bytes, kn + t * row_bytes, row_bytes);
      std::memcpy(v + slots[t] * row_bytes, vn + t * row_bytes, row_bytes);
    }
  });
}
// ANCHOR_END: cpu_kv_write

void PagedKVWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("PagedKVWrite: GPU streams use MLX's scatter with buffer donation");
}

namespace {

#include "paged_attention_metal_source.h"  // kMetalSource: metal/paged_attention.metal

mx::array paged_attention_metal(const mx::array& q, const mx::array& k_pages,
                                const mx::array& v_pages, const mx::array& block_table,
                                const mx::array& context_lens,
                                const mx::array& query_start_loc, float scale,
                                mx::Stream stream) {
  static auto kernel = mx::fast::metal_kernel(
      "tiny_llm_paged_attention",
      {"q", "k_pages", "v_pages", "block_table", "context_lens", "query_start_loc", "params"},
      {"out"},
      "threadgroup float tg_m[kSimdgroups * GROUP];\n"
      "threadgroup float tg_l[kSimdgroups * GROUP];\n"
      "threadgroup float tg_acc[GROUP * HEAD_DIM];\n"
      "paged_attention_jit_entry<T, HEAD_DIM, GROUP>(q, k_pages, v_pages, block_table,\n"
      "    context_lens, query_start_loc, params, out, tg_m, tg_l, tg_acc,\n"
      "    threadgroup_position_in_grid, simdgroup_index_in_threadgroup,\n"
      "    thread_index_in_simdgroup);\n",
      kMetalSource);
  const int T = q.shape(0), n_heads = q.shape(1), D = q.shape(2);
  const int n_kv_heads = k_pages.shape(2), page_size = k_pages.shape(1);
  // Params as a small int32 buffer (the JIT signature has no constant structs):
  // num_seqs, max_pages, n_heads, n_kv_heads, page_size, scale bits.
  int32_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof(scale));
  mx::array params({context_lens.shape(0), block_table.shape(1), n_heads, n_kv_heads,
                    page_size, scale_bits},
                   mx::int32);
  const int threads = 32 * 8;  // 8 simdgroups per threadgroup
  auto outs = kernel(
      {q, k_pages, v_pages, block_table, context_lens, query_start_loc, params},
      {q.shape()}, {q.dtype()}, {threads * T, n_kv_heads, 1}, {threads, 1, 1},
      {{"T", q.dtype()}, {"HEAD_DIM", D}, {"GROUP", n_heads / n_kv_heads}}, std::nullopt,
      false, stream);
  return outs[0];
}

}  // namespace

mx::array paged_attention(const mx::array& q, const mx::array& k_pages,
                          const mx::array& v_pages, const mx::array& block_table,
                          const mx::array& context_lens, const mx::array& query_start_loc,
                          float scale, mx::StreamOrDevice s) {
  check(q.ndim() == 3 && k_pages.ndim() == 4 && v_pages.shape() == k_pages.shape(),
        "q must be [T, Hq, D] and pages [P, page_size, Hkv, D]");
  check(is_float(q.dtype()) && k_pages.dtype() == q.dtype() && v_pages.dtype() == q.dtype(),
        "q and pages must share one float dtype");
  check(block_table.dtype() == mx::int32 && context_lens.dtype() == mx::int32 &&
            query_start_loc.dtype() == mx::int32,
        "block_table, context_lens and query_start_loc must be int32");
  auto stream = mx::to_stream(s);
  auto c = [&](const mx::array& a) { return mx::contiguous(a, false, stream); };
  if (stream.device == mx::Device::gpu) {
    return paged_attention_metal(c(q), c(k_pages), c(v_pages), c(block_table), c(context_lens),
                                 c(query_start_loc), scale, stream);
  }
  return mx::array(q.shape(), q.dtype(), std::make_shared<PagedAttention>(stream, scale),
                   {c(q), c(k_pages), c(v_pages), c(block_table), c(context_lens),
                    c(query_start_loc)});
}

std::tuple<mx::array, mx::array> paged_kv_write(const mx::array& k_pages,
                                                const mx::array& v_pages,
                                                const mx::array& k_new, const mx::array& v_new,
                                                const mx::array& slot_mapping,
                                                mx::StreamOrDevice s) {
  check(k_pages.ndim() == 4 && v_pages.shape() == k_pages.shape(),
        "pages must be [P, page_size, Hkv, D]");
  check(k_new.ndim() == 3 && v_new.shape() == k_new.shape() &&
            k_new.shape(1) == k_pages.shape(2) && k_new.shape(2) == k_pages.shape(3),
        "new rows must be [T, Hkv, D] matching the pages");
  check(k_new.dtype() == k_pages.dtype() && v_new.dtype() == v_pages.dtype(),
        "new rows must have the pages' dtype");
  check(slot_mapping.dtype() == mx::int32 && slot_mapping.ndim() == 1 &&
            slot_mapping.shape(0) == k_new.shape(0),
        "slot_mapping must be int32 [T]");
  auto stream = mx::to_stream(s);
  if (stream.device == mx::Device::gpu) {
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
  auto c = [&](const mx::array& a) { return mx::contiguous(a, false, stream); };
  auto outs = mx::array::make_arrays(
      {k_pages.shape(), v_pages.shape()}, {k_pages.dtype(), v_pages.dtype()},
      std::make_shared<PagedKVWrite>(stream),
      {k_pages, v_pages, c(k_new), c(v_new), c(slot_mapping)});
  return {outs[0], outs[1]};
}

}  // namespace tiny_llm
