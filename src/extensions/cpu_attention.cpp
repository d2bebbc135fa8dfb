// CPU schedules of paged attention (see cpu_attention.h).
#include "cpu_attention.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "mlx/types/half_types.h"
#include "worker_pool.h"

namespace tiny_llm {

namespace {

// ANCHOR: cpu_page_update
// Eight floats as one value (GCC's and Clang's vector extension): arithmetic on it runs
// lane by lane, in one vector register where the CPU has them.
typedef float Lanes8 __attribute__((vector_size(32)));

inline Lanes8 load8(const float* p) {
  Lanes8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A query row against a key row: lane j sums the d with d % 8 == j in increasing d, the
// lanes are added in a fixed tree, then the last D % 8 products in order.
inline float sum_tree(Lanes8 part) {
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

inline float dot(const float* a, const float* b, int D) {
  Lanes8 part = {};
  int d = 0;
  for (; d + 8 <= D; d += 8) part += load8(a + d) * load8(b + d);
  float sum = sum_tree(part);
  for (; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

// dot(a, k + i * stride, D) for the four keys i = 0..3, side by side: four independent
// chains of additions in flight instead of one (each key's sums in dot's own order).
inline void dot4(const float* a, const float* k, int64_t stride, int D, float* out) {
  Lanes8 part[4] = {};
  int d = 0;
  for (; d + 8 <= D; d += 8) {
    const Lanes8 q = load8(a + d);
    for (int i = 0; i < 4; ++i) part[i] += q * load8(k + i * stride + d);
  }
  for (int i = 0; i < 4; ++i) {
    float sum = sum_tree(part[i]);
    for (int e = d; e < D; ++e) sum += a[e] * k[i * stride + e];
    out[i] = sum;
  }
}

// exp of eight lanes at once (Cephes' single-precision polynomial, within about 2 ulp of
// std::exp), where a loop of std::exp calls runs one lane at a time: x = n ln 2 + r with
// |r| <= ln 2 / 2, exp(r) by a polynomial, times 2^n built in the exponent bits. Below -87
// the lanes give about 1e-38 where std::exp underflows to 0, nothing a softmax can see.
typedef int32_t Ints8 __attribute__((vector_size(32)));

inline Lanes8 exp8(Lanes8 x) {
  const Lanes8 lo = Lanes8{} - 87.0f, hi = Lanes8{} + 88.0f;
  x = x < lo ? lo : (x > hi ? hi : x);
  const Lanes8 shift = Lanes8{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Lanes8 n = (x * 1.44269504088896341f + shift) - shift;
  const Lanes8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Lanes8 p = Lanes8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const Ints8 bits = (__builtin_convertvector(n, Ints8) + 127) << 23;
  Lanes8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Fold one page of keys into the online softmax of one (query row, head): scores for
// the first `n` keys, then rescale (m, l, acc) to the new running max and add p * V.
// Both schedules call exactly this, so a row's result does not depend on the schedule
// or on how the prompt was chunked.
inline void fold_page(const float* qrow, const float* k, const float* v, int64_t stride, int n,
                      int D, float* score, float& m, float& l, float* acc) {
  // TASK 4.3: fold_page — Folding a page into the online softmax
  int t = 0;
  for (; t + 4 <= n; t += 4) dot4(qrow, k + t * stride, stride, D, score + t);
  for (; t < n; ++t) score[t] = dot(qrow, k + t * stride, D);
  float page_max = -FLT_MAX;
  for (t = 0; t < n; ++t) page_max = std::max(page_max, score[t]);
  const float new_m = std::max(m, page_max);
  const float correction = std::exp(m - new_m);
  m = new_m;
  l *= correction;
  // The weights p of the keys, eight at a time (score has room for a whole last vector).
  Lanes8 sum = {};
  for (t = 0; t < n; t += 8) {
    Lanes8 p = exp8(load8(score + t) - new_m);
    for (int i = n - t; i < 8; ++i) p[i] = 0.0f;  // lanes past the last key
    std::memcpy(score + t, &p, sizeof p);
    sum += p;
  }
  l += sum_tree(sum);
  // Columns of acc with the keys innermost: they stay in registers for the whole page
  // instead of a store and a reload per key. Sixty-four at a time (eight registers): eight
  // independent chains of additions, where eight columns alone wait on one.
  int d = 0;
  for (; d + 64 <= D; d += 64) {
    Lanes8 a[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) a[c] = load8(acc + d + 8 * c) * correction;
    for (t = 0; t < n; ++t) {
      const float p = score[t];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) a[c] += p * load8(v + t * stride + d + 8 * c);
    }
    std::memcpy(acc + d, a, sizeof a);
  }
  for (; d + 8 <= D; d += 8) {
    Lanes8 a = load8(acc + d) * correction;
    for (t = 0; t < n; ++t) a += score[t] * load8(v + t * stride + d);
    std::memcpy(acc + d, &a, sizeof a);
  }
  for (; d < D; ++d) {
    float a = acc[d] * correction;
    for (t = 0; t < n; ++t) a += score[t] * v[t * stride + d];
    acc[d] = a;
  }
  // END TASK
}
// ANCHOR_END: cpu_page_update

// ANCHOR: cpu_attend_rows
// `rows` consecutive query rows of one sequence (absolute positions first_pos, ...),
// for the G query heads sharing KV head `kv_head`, over the sequence's pages.
//
// rows == 1 is the vector (decode) schedule. rows > 1 is the tiled schedule: a query
// tile against one page (key tile) at a time, so each K/V page is read once for the
// whole tile; pages past the tile's last position are never visited (tiles above the
// causal diagonal are skipped) and, on the diagonal page, each row stops at itself.
template <typename T>
void attend_rows(const T* q, T* out, int rows, int first_pos, const T* k_pages,
                 const T* v_pages, const int32_t* table, int kv_head, const CpuAttentionShape& g) {
  const int G = g.n_heads / g.n_kv_heads, D = g.head_dim, ps = g.page_size;
  const int R = rows * G;  // (row, head) pairs of the tile
  const int64_t row_elems = static_cast<int64_t>(g.n_heads) * D;
  const int64_t slot_stride = static_cast<int64_t>(g.n_kv_heads) * D;
  constexpr bool kIsFloat = std::is_same_v<T, float>;
  const int score_len = (ps + 7) / 8 * 8;  // whole vectors of eight (fold_page's exp8)
  thread_local std::vector<float> buf;
  buf.assign(static_cast<size_t>(2 * R * D + 2 * R + score_len + (kIsFloat ? 0 : 2 * ps * D)),
             0.0f);
  float* qf = buf.data();
  float* acc = qf + R * D;
  float* m = acc + R * D;
  float* l = m + R;
  float* score = l + R;
  float* kv_f = score + score_len;  // the page converted to float (half/bfloat pages only)
  for (int r = 0; r < rows; ++r)
    for (int x = 0; x < G * D; ++x)
      qf[r * G * D + x] = static_cast<float>(q[r * row_elems + x]) * g.scale;
  std::fill(m, m + R, -FLT_MAX);
  // ANCHOR: cpu_tile_walk
  const int num_keys = first_pos + rows;  // the last row sees keys 0 .. first_pos + rows - 1
  // TASK 4.2: attend_rows, the page walk — The vector schedule on the CPU
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
  // END TASK
  // ANCHOR_END: cpu_tile_walk
  for (int r = 0; r < rows; ++r)
    for (int gi = 0; gi < G; ++gi) {
      const int x = r * G + gi;
      for (int d = 0; d < D; ++d)
        out[r * row_elems + gi * D + d] = static_cast<T>(acc[x * D + d] / l[x]);
    }
}
// ANCHOR_END: cpu_attend_rows

// A work item's rows: `rows` consecutive query rows of sequence `seq`, from flat row `row`.
struct Tile {
  int seq, row, rows;
};

// ANCHOR: cpu_row_items
// Day 4: every query row is its own work item (the vector schedule), even the rows of a
// multi-token query: each walks the pages of its own causal range.
std::vector<Tile> row_items(const int32_t* qsl, int num_seqs) {
  std::vector<Tile> items;
  for (int b = 0; b < num_seqs; ++b)
    for (int r = qsl[b]; r < qsl[b + 1]; ++r) items.push_back({b, r, 1});
  return items;
}
// ANCHOR_END: cpu_row_items

// ANCHOR: cpu_tile_items
// Day 5: consecutive rows of a sequence share a tile of up to `tile` rows, which reads
// each page once for all of them; a decode row is a tile of one.
std::vector<Tile> tile_items(const int32_t* qsl, int num_seqs, int tile) {
  std::vector<Tile> items;
  // TASK 5.3: tile_items — Tiles on the CPU
  for (int b = 0; b < num_seqs; ++b)
    for (int r = qsl[b]; r < qsl[b + 1]; r += tile)
      items.push_back({b, r, std::min(tile, qsl[b + 1] - r)});
  // END TASK
  return items;
}
// ANCHOR_END: cpu_tile_items

}  // namespace

// ANCHOR: cpu_work_items
// Work items: one per (tile of query rows, KV head); each walks only its own sequence's
// block table. Tiles of one row are the vector schedule.
template <typename T>
void paged_attention_cpu(const T* q, const T* k_pages, const T* v_pages, const int32_t* tables,
                         const int32_t* context_lens, const int32_t* qsl, T* out,
                         const CpuAttentionShape& g) {
  const std::vector<Tile> tiles = g.query_tile > 1 ? tile_items(qsl, g.num_seqs, g.query_tile)
                                                   : row_items(qsl, g.num_seqs);
  double keys = 0;  // (query row, key) pairs, to size the job for the worker pool
  for (int b = 0; b < g.num_seqs; ++b) keys += double(context_lens[b]) * (qsl[b + 1] - qsl[b]);
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
// ANCHOR_END: cpu_work_items

template void paged_attention_cpu<float>(const float*, const float*, const float*,
                                         const int32_t*, const int32_t*, const int32_t*, float*,
                                         const CpuAttentionShape&);
template void paged_attention_cpu<mlx::core::float16_t>(
    const mlx::core::float16_t*, const mlx::core::float16_t*, const mlx::core::float16_t*,
    const int32_t*, const int32_t*, const int32_t*, mlx::core::float16_t*,
    const CpuAttentionShape&);
template void paged_attention_cpu<mlx::core::bfloat16_t>(
    const mlx::core::bfloat16_t*, const mlx::core::bfloat16_t*, const mlx::core::bfloat16_t*,
    const int32_t*, const int32_t*, const int32_t*, mlx::core::bfloat16_t*,
    const CpuAttentionShape&);

}  // namespace tiny_llm
