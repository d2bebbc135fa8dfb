// CPU kernels and op entry points for paged attention (see paged_attention.h).
//
// CPU schedules. Vector (Day 4): one work item per (decode row, KV head) walks its
// sequence's block table page by page and keeps an online softmax (running max m,
// running sum l, running output acc) for the G query heads sharing the KV head, so each
// K/V row is read once for the whole group. Tiled (Day 5): rows of multi-token queries
// go in tiles of 16 that share every page they read. Items run on all cores.
//
// GPU: the same schedule as a Metal kernel (metal/paged_attention.metal), compiled at
// run time by MLX (fast::metal_kernel), so no Metal toolchain is needed to build.
#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

namespace tiny_llm {

namespace {

std::atomic<int> g_pool_copies{0};
std::atomic<int> g_num_threads{0};

// ANCHOR: cpu_threads
// Worker threads that live as long as the process: a kernel runs once per layer per
// step, and spawning threads for each call cost more than small calls take.
class WorkerPool {
 public:
  static WorkerPool& instance() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: workers may be waiting
    return *pool;
  }

  // Runs fn(0..n-1) on `threads` threads, the calling one included.
  void run(int n, int threads, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> one_job(job_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(workers_.size()) < threads - 1) {
        const int id = static_cast<int>(workers_.size());
        workers_.emplace_back([this, id] { serve(id); });
      }
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      helpers_ = pending_ = threads - 1;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    // Every thread is done with fn before an error leaves this frame (fn lives in it).
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void drain() {
    for (int i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_);  // hand out no more items
      }
    }
  }

  void serve(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (id >= helpers_) continue;
      lock.unlock();
      drain();
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex job_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<int> next_{0};
  int n_ = 0, helpers_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
};

// Runs fn(0..n-1) on up to the machine's threads; small jobs stay on the calling thread.
void parallel_for(int n, double flops_per_item, const std::function<void(int)>& fn) {
  int hw = g_num_threads.load();
  if (hw <= 0) hw = std::max(1u, std::thread::hardware_concurrency());
  const double total = n * flops_per_item;
  const int threads = std::min({hw, n, std::max(1, static_cast<int>(total / 2e5))});
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  WorkerPool::instance().run(n, threads, fn);
}
// ANCHOR_END: cpu_threads

struct Geometry {
  int num_seqs, max_pages, n_heads, n_kv_heads, head_dim, page_size;
  float scale;
};

// ANCHOR: cpu_page_update
// Fold one page of keys into the online softmax of one (query row, head): scores for
// the first `n` keys, then rescale (m, l, acc) to the new running max and add p * V.
// Both schedules call exactly this, so a row's result does not depend on the schedule
// or on how the prompt was chunked.
inline void fold_page(const float* qrow, const float* k, const float* v, int64_t stride, int n,
                      int D, float* score, float& m, float& l, float* acc) {
  float page_max = -FLT_MAX;
  for (int t = 0; t < n; ++t) {
    const float* krow = k + t * stride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < D; ++d) dot += qrow[d] * krow[d];
    score[t] = dot;
    page_max = std::max(page_max, dot);
  }
  const float new_m = std::max(m, page_max);
  const float correction = std::exp(m - new_m);
  l *= correction;
  for (int d = 0; d < D; ++d) acc[d] *= correction;
  m = new_m;
  for (int t = 0; t < n; ++t) {
    const float p = std::exp(score[t] - new_m);
    l += p;
    const float* vrow = v + t * stride;
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[d] += p * vrow[d];
  }
}
// ANCHOR_END: cpu_page_update

// ANCHOR: cpu_schedules
// `rows` consecutive query rows of one sequence (absolute positions first_pos, ...),
// for the G query heads sharing KV head `kv_head`, over the sequence's pages.
//
// rows == 1 is the vector (decode) schedule. rows > 1 is the tiled schedule: a query
// tile against one page (key tile) at a time, so each K/V page is read once for the
// whole tile; pages past the tile's last position are never visited (tiles above the
// causal diagonal are skipped) and, on the diagonal page, each row stops at itself.
template <typename T>
void attend_rows(const T* q, T* out, int rows, int first_pos, const T* k_pages,
                 const T* v_pages, const int32_t* table, int kv_head, const Geometry& g) {
  const int G = g.n_heads / g.n_kv_heads, D = g.head_dim, ps = g.page_size;
  const int R = rows * G;  // (row, head) pairs of the tile
  const int64_t row_elems = static_cast<int64_t>(g.n_heads) * D;
  const int64_t slot_stride = static_cast<int64_t>(g.n_kv_heads) * D;
  constexpr bool kIsFloat = std::is_same_v<T, float>;
  thread_local std::vector<float> buf;
  buf.assign(static_cast<size_t>(2 * R * D + 2 * R + ps + (kIsFloat ? 0 : 2 * ps * D)), 0.0f);
  float* qf = buf.data();
  float* acc = qf + R * D;
  float* m = acc + R * D;
  float* l = m + R;
  float* score = l + R;
  float* kv_f = score + ps;  // the page converted to float (half/bfloat pages only)
  for (int r = 0; r < rows; ++r)
    for (int x = 0; x < G * D; ++x)
      qf[r * G * D + x] = static_cast<float>(q[r * row_elems + x]) * g.scale;
  std::fill(m, m + R, -FLT_MAX);
  // ANCHOR: cpu_tile_walk
  const int num_keys = first_pos + rows;  // the last row sees keys 0 .. first_pos + rows - 1
  for (int start = 0, j = 0; start < num_keys; start += ps, ++j) {
    const int n = std::min(ps, num_keys - start);
    // Address translation: logical page j of this sequence is physical page table[j].
    const int64_t base = static_cast<int64_t>(table[j]) * ps * slot_stride + kv_head * D;
    const float* k;
    const float* v;
    int64_t stride;
    if constexpr (kIsFloat) {
      k = k_pages + base, v = v_pages + base, stride = slot_stride;
    } else {
      for (int t = 0; t < n; ++t)
        for (int d = 0; d < D; ++d) {
          kv_f[t * D + d] = static_cast<float>(k_pages[base + t * slot_stride + d]);
          kv_f[(ps + t) * D + d] = static_cast<float>(v_pages[base + t * slot_stride + d]);
        }
      k = kv_f, v = kv_f + ps * D, stride = D;
    }
    for (int r = 0; r < rows; ++r) {
      const int visible = std::min(n, first_pos + r + 1 - start);  // causal within the page
      if (visible <= 0) continue;
      for (int gi = 0; gi < G; ++gi) {
        const int x = r * G + gi;
        fold_page(qf + x * D, k, v, stride, visible, D, score, m[x], l[x], acc + x * D);
      }
    }
  }
  // ANCHOR_END: cpu_tile_walk
  for (int r = 0; r < rows; ++r)
    for (int gi = 0; gi < G; ++gi) {
      const int x = r * G + gi;
      for (int d = 0; d < D; ++d)
        out[r * row_elems + gi * D + d] = static_cast<T>(acc[x * D + d] / l[x]);
    }
}

constexpr int kQueryTile = 16;

// Work items: one per (decode row, KV head) and one per (query tile, KV head) for rows of
// multi-token queries; each walks only its own sequence's block table.
template <typename T>
void paged_attention_cpu(const T* q, const T* k_pages, const T* v_pages, const int32_t* tables,
                         const int32_t* context_lens, const int32_t* qsl, T* out,
                         Geometry g) {
  struct Tile { int seq, row, rows; };
  std::vector<Tile> tiles;
  double keys = 0;
  for (int b = 0; b < g.num_seqs; ++b) {
    const int len = qsl[b + 1] - qsl[b];
    for (int r = qsl[b]; r < qsl[b + 1]; r += kQueryTile)
      tiles.push_back({b, r, std::min(kQueryTile, qsl[b + 1] - r)});
    keys += double(context_lens[b]) * len;
  }
  const int G = g.n_heads / g.n_kv_heads;
  const int64_t row_elems = static_cast<int64_t>(g.n_heads) * g.head_dim;
  const int items = static_cast<int>(tiles.size()) * g.n_kv_heads;
  const double flops = 4.0 * G * g.head_dim * keys / std::max(1, items);
  parallel_for(items, flops, [&](int item) {
    const Tile& tile = tiles[item / g.n_kv_heads];
    const int h = item % g.n_kv_heads, b = tile.seq;
    const int query_len = qsl[b + 1] - qsl[b];
    const int first_pos = context_lens[b] - query_len + (tile.row - qsl[b]);
    const int64_t offset = tile.row * row_elems + static_cast<int64_t>(h) * G * g.head_dim;
    attend_rows(q + offset, out + offset, tile.rows, first_pos, k_pages, v_pages,
                tables + static_cast<int64_t>(b) * g.max_pages, h, g);
  });
}
// ANCHOR_END: cpu_schedules

// ANCHOR: cpu_dispatch
template <typename T>
void dispatch_attention(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& in,
                        mx::array& out, const Geometry& g) {
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

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("tiny_llm paged ops: " + message);
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

}  // namespace

int pool_copies() { return g_pool_copies.load(); }

void set_num_threads(int n) { g_num_threads.store(n); }

// ANCHOR: cpu_eval
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
// ANCHOR_END: cpu_eval

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  return scale_ == static_cast<const PagedAttention&>(other).scale_;
}

// ANCHOR: cpu_kv_write
// One pool per primitive: a multi-output primitive would hold the pools in each sibling's
// input list, and an input held twice is never donatable.
void PagedKVWrite::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const auto& pool = inputs[0];
  const auto& rows = inputs[1];
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
  const int64_t row_bytes = rows.nbytes() / std::max<int64_t>(1, rows.shape(0));
  enc.dispatch([dst = out.data<char>(), src = rows.data<char>(),
                slots = inputs[2].data<int32_t>(), n = rows.shape(0), row_bytes]() {
    for (int64_t t = 0; t < n; ++t)
      std::memcpy(dst + slots[t] * row_bytes, src + t * row_bytes, row_bytes);
  });
}
// ANCHOR_END: cpu_kv_write

void PagedKVWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("PagedKVWrite: GPU streams use MLX's scatter with buffer donation");
}

namespace {

// ANCHOR: metal_jit
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
      "threadgroup float tg_m[state_floats(GROUP)];\n"
      "threadgroup float tg_l[kSimdgroups * GROUP];\n"
      "threadgroup float tg_acc[GROUP * HEAD_DIM];\n"
      "threadgroup float k_tile[8 * HEAD_DIM];\n"
      "threadgroup float v_tile[8 * HEAD_DIM];\n"
      "threadgroup float scratch[64 * kSimdgroups];\n"
      "paged_attention_jit_entry<T, HEAD_DIM, GROUP>(q, k_pages, v_pages, block_table,\n"
      "    context_lens, query_start_loc, params, out, tg_m, tg_l, tg_acc, k_tile, v_tile,\n"
      "    scratch, threadgroup_position_in_grid, threadgroups_per_grid,\n"
      "    simdgroup_index_in_threadgroup, thread_index_in_simdgroup,\n"
      "    thread_index_in_threadgroup);\n",
      kMetalSource);
  const int T = q.shape(0), n_heads = q.shape(1), D = q.shape(2);
  const int n_kv_heads = k_pages.shape(2), page_size = k_pages.shape(1);
  // Params as a small int32 buffer (the JIT signature has no constant structs):
  // num_seqs, max_pages, n_heads, n_kv_heads, page_size, scale bits.
  int32_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof(scale));
  mx::array params({context_lens.shape(0), block_table.shape(1), n_heads, n_kv_heads,
                    page_size, scale_bits, 0, 0},
                   mx::int32);
  const int group = n_heads / n_kv_heads;
  check(page_size % 8 == 0, "the Metal kernel needs page_size to be a multiple of 8");
  // Threadgroup memory of the kernel (floats), against Metal's 32 KiB.
  const int tg_floats = std::max(64, 8 * group) + 8 * group + group * D + 16 * D + 512;
  check(group <= 64 && 64 % group == 0 && tg_floats * 4 <= 32768,
        "the Metal kernel supports head_dim x GQA group sizes whose state fits 32 KiB of "
        "threadgroup memory, with the group dividing 64");
  // MLX's JIT passes inputs of fewer than 8 elements in the `constant` address space; the
  // kernel reads all metadata as `device` memory, so small arrays are padded to 8.
  auto at_least_8 = [&](const mx::array& a) {
    auto flat = mx::reshape(a, {-1}, stream);
    const int n = flat.shape(0);
    const auto zero = mx::array(0, mx::int32);
    return n >= 8 ? flat : mx::pad(flat, std::make_pair(0, 8 - n), zero, "constant", stream);
  };
  // Threadgroups: one per query row (vector schedule), then one per (sequence, query
  // tile) (tiled schedule); each keeps only the work its sequence's query length selects.
  const int tiles_per_seq = (T + 64 / group - 1) / (64 / group);
  const int groups_x = T + context_lens.shape(0) * tiles_per_seq;
  const int threads = 32 * 8;  // 8 simdgroups per threadgroup
  auto outs = kernel(
      {q, k_pages, v_pages, at_least_8(block_table), at_least_8(context_lens),
       at_least_8(query_start_loc), params},
      {q.shape()}, {q.dtype()}, {threads * groups_x, n_kv_heads, 1}, {threads, 1, 1},
      {{"T", q.dtype()}, {"HEAD_DIM", D}, {"GROUP", n_heads / n_kv_heads}}, std::nullopt,
      false, stream);
  return outs[0];
}
// ANCHOR_END: metal_jit

}  // namespace

// ANCHOR: op_entry
mx::array paged_attention(const mx::array& q, const mx::array& k_pages,
                          const mx::array& v_pages, const mx::array& block_table,
                          const mx::array& context_lens, const mx::array& query_start_loc,
                          float scale, mx::StreamOrDevice s) {
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
  check(k_new.dtype() == k_pages.dtype() && v_new.dtype() == v_pages.dtype() &&
            v_pages.dtype() == k_pages.dtype(),
        "pools and new rows must share one dtype");
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
  auto write = [&](const mx::array& pages, const mx::array& rows_new) {
    return mx::array(pages.shape(), pages.dtype(), std::make_shared<PagedKVWrite>(stream),
                     {pages, c(rows_new), c(slot_mapping)});
  };
  return {write(k_pages, k_new), write(v_pages, v_new)};
}
// ANCHOR_END: op_entry

}  // namespace tiny_llm
