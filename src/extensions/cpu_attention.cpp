// CPU schedules of paged attention (see cpu_attention.h).
#include "cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"
#include "mlx/types/half_types.h"
#include "profile.h"
#include "worker_pool.h"

namespace tiny_llm {

namespace {

// Not FLT_MAX: with libc++ in C++20 a Darwin <cmath> can include <float.h> for NAN and
// INFINITY alone, and <cfloat> then adds nothing.
constexpr float kFloatMax = std::numeric_limits<float>::max();

// ANCHOR: cpu_tuned_fold
using namespace simd;  // Lanes8 and its operations (cpu_simd.h)

// A query row against a key row: lane j sums the d with d % 8 == j in increasing d, the
// lanes are added in a fixed tree, then the last D % 8 products in order.
inline float dot(const float* a, const float* b, int D) {
  Lanes8 part = {};
  int d = 0;
  for (; d + 8 <= D; d += 8) part = fma(load8(a + d), load8(b + d), part);
  float sum = sum_tree(part);
  for (; d < D; ++d) sum = fma(a[d], b[d], sum);
  return sum;
}

// Pairs folded together by fold_page: as many as the vector registers hold the state of
// (four keys' scores or 32 columns of acc per pair, and the shared key or value vectors).
#if defined(__AVX512VL__)
constexpr int kPairsPerFold = 3;
#else
constexpr int kPairsPerFold = 2;
#endif

// Fold one page of keys into the online softmax of P (query row, head) pairs that all see
// its first `n` keys: the P query rows q, P running maxima m and sums l, P rows of acc, and
// P rows of score (score_len floats each, a whole number of vectors of eight). For each
// pair: the scores, the new running max, the rescale of l and acc, then p * V. Every
// schedule folds through this, and a pair's arithmetic does not depend on P or on the
// other pairs, so a row's result does not depend on the schedule or on how the prompt
// was chunked.
#if !defined(TINY_LLM_COURSE_KERNEL)  // a learner's build has only the fold they write
template <int P>
inline void fold_page(const float* q, const float* k, const float* v,
                                       int64_t stride, int n, int D, float* score,
                                       int score_len, float* m, float* l, float* acc) {
  // Scores four keys at a time, each in dot's order: every key vector loaded once for the
  // P pairs, 4 P independent chains of additions in flight.
  int t = 0;
  for (; t + 4 <= n; t += 4) {
    Lanes8 part[P][4] = {};
    int d = 0;
    for (; d + 8 <= D; d += 8) {
      Lanes8 key[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) key[i] = load8(k + (t + i) * stride + d);
      if constexpr (P > 1)
        for (int i = 0; i < 4; ++i) key[i] = in_register(key[i]);  // used P times
#pragma GCC unroll 4
      for (int x = 0; x < P; ++x) {
        const Lanes8 qv = in_register(load8(q + x * D + d));  // used four times
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) part[x][i] = fma(qv, key[i], part[x][i]);
      }
    }
    for (int x = 0; x < P; x += 2) {  // two pairs' sums in one sum_trees8
      const Lanes8 sums = sum_trees8(part[x], part[x + 1 < P ? x + 1 : x]);
      if (d == D) {  // no columns past the vectors: the scores as they are, four a pair
        float four[8];
        std::memcpy(four, &sums, sizeof four);
        std::memcpy(score + x * score_len + t, four, 4 * sizeof(float));
        if (x + 1 < P) std::memcpy(score + (x + 1) * score_len + t, four + 4, 4 * sizeof(float));
        continue;
      }
      for (int y = x; y < std::min(x + 2, P); ++y)
        for (int i = 0; i < 4; ++i) {
          float sum = sums[4 * (y - x) + i];
          for (int e = d; e < D; ++e) sum = fma(q[y * D + e], k[(t + i) * stride + e], sum);
          score[y * score_len + t + i] = sum;
        }
    }
  }
  for (; t < n; ++t)
    for (int x = 0; x < P; ++x) score[x * score_len + t] = dot(q + x * D, k + t * stride, D);
  float correction[P];
  const Ints8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int x = 0; x < P; ++x) {
    float* s = score + x * score_len;
    Lanes8 maxima = Lanes8{} - kFloatMax;  // lane j: the largest of keys j, j + 8, ...
    for (t = 0; t < n; t += 8) {
      const Lanes8 v = load8(s + t);
      maxima = ((lane < n - t) & (v > maxima)) ? v : maxima;
    }
    float page_max = maxima[0];
    for (int j = 1; j < 8; ++j) page_max = std::max(page_max, maxima[j]);
    const float new_m = std::max(m[x], page_max);
    correction[x] = std::exp(m[x] - new_m);
    m[x] = new_m;
    l[x] *= correction[x];
    // The weights p of the keys, eight at a time (s has room for a whole last vector).
    Lanes8 sum = {};
    for (t = 0; t < n; t += 8) {
      Lanes8 p = exp8(load8(s + t) - new_m);
      p = lane < n - t ? p : Lanes8{};  // lanes past the last key: 0
      std::memcpy(s + t, &p, sizeof p);
      sum += p;
    }
    l[x] += sum_tree(sum);
  }
  // Columns of acc with the keys innermost: they stay in registers for the whole page
  // instead of a store and a reload per key, and each value vector is loaded once for
  // the P pairs. C registers of columns a pair (eight for one pair, four for more):
  // C P independent chains of additions, where one register's alone would wait on each
  // link.
  constexpr int C = P == 1 ? 8 : 4;
  int d = 0;
  for (; d + 8 * C <= D; d += 8 * C) {
    Lanes8 a[P][C];
#pragma GCC unroll 4
    for (int x = 0; x < P; ++x)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a[x][c] = load8(acc + x * D + d + 8 * c) * correction[x];
    for (t = 0; t < n; ++t) {
      Lanes8 value[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) value[c] = load8(v + t * stride + d + 8 * c);
      if constexpr (P > 1)
        for (int c = 0; c < C; ++c) value[c] = in_register(value[c]);  // used P times
#pragma GCC unroll 4
      for (int x = 0; x < P; ++x) {
        const Lanes8 p = score[x * score_len + t] - Lanes8{};  // in every lane (x - 0 is x)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) a[x][c] = fma(p, value[c], a[x][c]);
      }
    }
    for (int x = 0; x < P; ++x) std::memcpy(acc + x * D + d, a[x], sizeof a[x]);
  }
  for (; d + 8 <= D; d += 8)
    for (int x = 0; x < P; ++x) {
      Lanes8 a = load8(acc + x * D + d) * correction[x];
      for (t = 0; t < n; ++t)
        a = fma(score[x * score_len + t] - Lanes8{}, load8(v + t * stride + d), a);
      std::memcpy(acc + x * D + d, &a, sizeof a);
    }
  for (; d < D; ++d)
    for (int x = 0; x < P; ++x) {
      float a = acc[x * D + d] * correction[x];
      for (t = 0; t < n; ++t) a = fma(score[x * score_len + t], v[t * stride + d], a);
      acc[x * D + d] = a;
    }
}
#endif
// ANCHOR_END: cpu_tuned_fold

// ANCHOR: cpu_page_update
// Fold one page of keys into the online softmax of one (query row, head) pair that sees its
// first `n` keys: query q, running max m and sum l, the row's acc (D floats), and room for
// the page's n scores. The scores, the new running max, the rescale of l and acc, then
// p * V. The course's fold (the learner's build runs it); the engine's build runs the tuned
// fold_page above, tested against it.
[[maybe_unused]] inline void fold_page_plain(const float* q, const float* k, const float* v,
                                             int64_t stride, int n, int D, float* score,
                                             float* m, float* l, float* acc) {
  // TASK 4.2: walk_pages and fold_page_plain — The vector schedule on the CPU
  float page_max = -kFloatMax;
  for (int t = 0; t < n; ++t) {
    score[t] = dot(q, k + t * stride, D);
    page_max = std::max(page_max, score[t]);
  }
  const float new_m = std::max(*m, page_max);
  const float correction = std::exp(*m - new_m);  // 0 on the first page: m starts at -FLT_MAX
  *m = new_m;
  *l *= correction;
  for (int d = 0; d < D; ++d) acc[d] *= correction;
  for (int t = 0; t < n; ++t) {
    const float p = std::exp(score[t] - new_m);
    *l += p;
    for (int d = 0; d < D; ++d) acc[d] = fma(p, v[t * stride + d], acc[d]);
  }
  // END TASK
}

// `count` consecutive pairs that all see the page's first n keys: one at a time in the
// course's build (TINY_LLM_COURSE_KERNEL), else kPairsPerFold at a time by the tuned fold.
inline void fold_pairs(const float* q, int count, const float* k, const float* v,
                       int64_t stride, int n, int D, float* score, int score_len, float* m,
                       float* l, float* acc) {
#if defined(TINY_LLM_COURSE_KERNEL)
  (void)score_len;
  for (int x = 0; x < count; ++x)
    fold_page_plain(q + x * D, k, v, stride, n, D, score, m + x, l + x, acc + x * D);
#else
  int x = 0;
  for (; x + kPairsPerFold <= count; x += kPairsPerFold)
    fold_page<kPairsPerFold>(q + x * D, k, v, stride, n, D, score, score_len, m + x, l + x,
                             acc + x * D);
  for (; x < count; ++x)
    fold_page<1>(q + x * D, k, v, stride, n, D, score, score_len, m + x, l + x, acc + x * D);
#endif
}
// ANCHOR_END: cpu_page_update

// Asks the memory system now for n rows of D values at stride `stride` from `base` in both
// pools (one request per 64-byte line): a page walk otherwise waits one page's memory
// latency after another, since a page's address is only known from the block table.
template <typename T>
inline void prefetch_rows(const T* k_pages, const T* v_pages, int64_t base, int n, int D,
                          int64_t stride) {
  constexpr int kLine = 64 / sizeof(T);
  for (int t = 0; t < n; ++t)
    for (int d = 0; d < D; d += kLine) {
      __builtin_prefetch(k_pages + base + t * stride + d);
      __builtin_prefetch(v_pages + base + t * stride + d);
    }
}

// ANCHOR: cpu_chunks
// A sequence's keys are folded in chunks of kChunkPages pages, each chunk into fresh
// states, and the chunks' states merged in order. A long decode row's chunks can then be
// folded on different cores at once and merged after: the same arithmetic, and so the
// same bits, as one core folding the chunks in turn, in any schedule.
constexpr int kChunkPages = 8;

// Online-softmax states of (row, head) pairs: running maxima m, sums l, unnormalised acc.
struct PairStates {
  float *m, *l, *acc;
};

// The states of `pairs` pairs over a chunk of keys (c) merged into their states over the
// keys before it (s), the merge rule of the Metal kernel's simdgroups: both rescaled to
// the larger maximum, then added. A pair the chunk had no key for (l == 0) is left as it
// is, and a pair with no keys before takes the chunk's state as it is.
inline void merge_chunk(PairStates s, PairStates c, int pairs, int D) {
  for (int x = 0; x < pairs; ++x) {
    float *acc = s.acc + x * D, *chunk = c.acc + x * D;
    if (c.l[x] == 0.0f) continue;
    if (s.l[x] == 0.0f) {
      s.m[x] = c.m[x], s.l[x] = c.l[x];
      std::memcpy(acc, chunk, sizeof(float) * D);
      continue;
    }
    const float m = std::max(s.m[x], c.m[x]);
    const float a = std::exp(s.m[x] - m), b = std::exp(c.m[x] - m);
    s.m[x] = m;
    s.l[x] = std::fma(c.l[x], b, s.l[x] * a);  // fma spelled out: one rounding everywhere
    for (int d = 0; d < D; ++d) acc[d] = std::fma(chunk[d], b, acc[d] * a);
  }
}
// ANCHOR_END: cpu_chunks

// ANCHOR: cpu_attend_rows
// `rows` consecutive query rows of one sequence (absolute positions first_pos, ...),
// for the G query heads sharing KV head `kv_head` (q points at the first of them): the
// pages [j0, j1) of the sequence folded into the rows' pair states `st` (qf: their
// queries, scaled; score and kv_f: scratch).
//
// rows == 1 is the vector (decode) schedule. rows > 1 is the tiled schedule: a query
// tile against one page (key tile) at a time, so each K/V page is read once for the
// whole tile; pages past the tile's last position are never visited (tiles above the
// causal diagonal are skipped) and, on the diagonal page, each row stops at itself.
template <typename T>
void walk_pages(const float* qf, int rows, int first_pos, const T* k_pages, const T* v_pages,
                const int32_t* table, int kv_head, int G, int j0, int j1,
                const CpuAttentionShape& g, float* score, float* kv_f, PairStates st) {
  const int D = g.head_dim, ps = g.page_size;
  const int64_t slot_stride = static_cast<int64_t>(g.n_kv_heads) * D;
  const int score_len = (ps + 7) / 8 * 8;  // whole vectors of eight (fold_page's exp8)
  float *m = st.m, *l = st.l, *acc = st.acc;
  // ANCHOR: cpu_tile_walk
  const int num_keys = first_pos + rows;  // the last row sees keys 0 .. first_pos + rows - 1
  // TASK 4.2: walk_pages and fold_page_plain — The vector schedule on the CPU
  for (int j = j0, start = j0 * ps; j < j1 && start < num_keys; ++j, start += ps) {
    const int n = std::min(ps, num_keys - start);
    // Address translation: logical page j of this sequence is physical page table[j].
    const int64_t base = static_cast<int64_t>(table[j]) * ps * slot_stride + kv_head * D;
    if (j + 1 < j1 && start + ps < num_keys)  // the next page's rows, fetched meanwhile
      prefetch_rows(k_pages, v_pages, static_cast<int64_t>(table[j + 1]) * ps * slot_stride +
                    kv_head * D, std::min(ps, num_keys - start - ps), D, slot_stride);
    const float* k;
    const float* v;
    int64_t stride;
    if constexpr (std::is_same_v<T, float>) {
      k = k_pages + base, v = v_pages + base, stride = slot_stride;
    } else {
      for (int t = 0; t < n; ++t)
        for (int d = 0; d < D; ++d) {
          kv_f[t * D + d] = static_cast<float>(k_pages[base + t * slot_stride + d]);
          kv_f[(ps + t) * D + d] = static_cast<float>(v_pages[base + t * slot_stride + d]);
        }
      k = kv_f, v = kv_f + ps * D, stride = D;
    }
    // Rows from `full` on see the whole page (on every page but the diagonal one, all rows
    // do): all their pairs fold it in one call. A row before `full` sees the keys up to
    // itself only, so its G pairs fold alone.
    const int full = std::clamp(start + n - 1 - first_pos, 0, rows);
    for (int r = 0; r < full; ++r) {
      const int visible = first_pos + r + 1 - start;  // causal within the page
      if (visible <= 0) continue;
      fold_pairs(qf + r * G * D, G, k, v, stride, visible, D, score, score_len, m + r * G,
                 l + r * G, acc + r * G * D);
    }
    fold_pairs(qf + full * G * D, (rows - full) * G, k, v, stride, n, D, score, score_len,
               m + full * G, l + full * G, acc + full * G * D);
  }
  // END TASK
  // ANCHOR_END: cpu_tile_walk
}

// The rows' chunks [c0, c1) of keys, each walked into fresh states and merged in order
// into `total` (the states over the chunks before c0; l = 0: none).
template <typename T>
void attend_chunks(const T* q, int rows, int first_pos, const T* k_pages, const T* v_pages,
                   const int32_t* table, int kv_head, int G, int c0, int c1,
                   const CpuAttentionShape& g, PairStates total) {
  const int D = g.head_dim, ps = g.page_size, R = rows * G;  // (row, head) pairs
  const int64_t row_elems = static_cast<int64_t>(g.n_heads) * D;
  const int score_len = (ps + 7) / 8 * 8;
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(2 * R * D + 2 * R + kPairsPerFold * score_len + 2 * ps * D));
  float* qf = buf.data();
  const PairStates chunk{qf + R * D, qf + R * D + R, qf + R * D + 2 * R};
  float* score = chunk.acc + R * D;
  float* kv_f = score + kPairsPerFold * score_len;  // the page as float (half/bfloat pools)
  for (int r = 0; r < rows; ++r)
    for (int x = 0; x < G * D; ++x)
      qf[r * G * D + x] = static_cast<float>(q[r * row_elems + x]) * g.scale;
  for (int c = c0; c < c1; ++c) {
    std::fill(chunk.m, chunk.m + R, -kFloatMax);
    std::fill(chunk.l, chunk.l + R, 0.0f);
    std::fill(chunk.acc, chunk.acc + R * D, 0.0f);
    walk_pages(qf, rows, first_pos, k_pages, v_pages, table, kv_head, G, c * kChunkPages,
               (c + 1) * kChunkPages, g, score, kv_f, chunk);
    merge_chunk(total, chunk, R, D);
  }
}

// out = acc / l of each pair, the rows' G heads at a time.
template <typename T>
void write_rows(PairStates st, int rows, int G, const CpuAttentionShape& g, T* out) {
  const int D = g.head_dim;
  const int64_t row_elems = static_cast<int64_t>(g.n_heads) * D;
  for (int r = 0; r < rows; ++r)
    for (int gi = 0; gi < G; ++gi) {
      const int x = r * G + gi;
      for (int d = 0; d < D; ++d)
        out[r * row_elems + gi * D + d] = static_cast<T>(st.acc[x * D + d] / st.l[x]);
    }
}

// Chunks of keys that the tile's last row sees.
inline int chunks_of(int num_keys, int page_size) {
  return (num_keys + kChunkPages * page_size - 1) / (kChunkPages * page_size);
}
// ANCHOR_END: cpu_attend_rows

// ANCHOR: cpu_tree_row
// A row of a token tree (CpuTreeRows): the keys before `start` as a causal row at
// start - 1 sees them (the usual walk), then each tree key it sees (bit j of mask: key
// start + j), one key at a time, merged in order as the walk's chunks are.
template <typename T>
void attend_tree_row(const T* q, int start, uint64_t mask, const T* k_pages, const T* v_pages,
                     const int32_t* table, int kv_head, int G, const CpuAttentionShape& g,
                     PairStates total) {
  attend_chunks(q, 1, start - 1, k_pages, v_pages, table, kv_head, G, 0,
                chunks_of(start, g.page_size), g, total);
  const int D = g.head_dim, ps = g.page_size;
  const int64_t slot_stride = static_cast<int64_t>(g.n_kv_heads) * D;
  constexpr int kScoreLen = 8;  // one key's score, in a whole vector
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(2 * G * D + 2 * G + kPairsPerFold * kScoreLen + 2 * D));
  float* qf = buf.data();
  const PairStates key_state{qf + G * D, qf + G * D + G, qf + G * D + 2 * G};
  float* score = key_state.acc + G * D;
  float* kv = score + kPairsPerFold * kScoreLen;  // the key's K and V rows as float
  for (int x = 0; x < G * D; ++x) qf[x] = static_cast<float>(q[x]) * g.scale;
  for (int j = 0; j < 64; ++j) {
    if (!(mask >> j & 1)) continue;
    const int key = start + j;
    const int64_t row = (static_cast<int64_t>(table[key / ps]) * ps + key % ps) * slot_stride +
                        kv_head * D;
    for (int d = 0; d < D; ++d) {
      kv[d] = static_cast<float>(k_pages[row + d]);
      kv[D + d] = static_cast<float>(v_pages[row + d]);
    }
    std::fill(key_state.m, key_state.m + G, -kFloatMax);
    std::fill(key_state.l, key_state.l + G, 0.0f);
    std::fill(key_state.acc, key_state.acc + G * D, 0.0f);
    fold_pairs(qf, G, kv, kv + D, D, 1, D, score, kScoreLen, key_state.m, key_state.l,
               key_state.acc);
    merge_chunk(total, key_state, G, D);
  }
}
// ANCHOR_END: cpu_tree_row

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

// The work items must cover each sequence's query rows exactly once, in tiles of 1 to `tile`
// rows inside their sequence: anything else (a wrong Task 5.3) would read and write past a
// sequence's rows, so it is refused here, by name, before any item runs.
void check_items(const std::vector<Tile>& items, const int32_t* qsl, int num_seqs, int tile) {
  std::vector<char> covered(static_cast<size_t>(std::max(0, qsl[num_seqs])), 0);
  for (const Tile& it : items) {
    const bool inside = it.seq >= 0 && it.seq < num_seqs && it.rows >= 1 && it.rows <= tile &&
                        it.row >= qsl[std::max(0, it.seq)] &&
                        it.row + it.rows <= qsl[std::max(0, it.seq) + 1];
    if (!inside) {
      const std::string rows =
          it.seq >= 0 && it.seq < num_seqs
              ? "rows " + std::to_string(qsl[it.seq]) + ".." + std::to_string(qsl[it.seq + 1] - 1)
              : "no rows (there are " + std::to_string(num_seqs) + " sequences)";
      throw std::runtime_error(
          "Task 5.3 (tile_items): the item {seq " + std::to_string(it.seq) + ", row " +
          std::to_string(it.row) + ", rows " + std::to_string(it.rows) + "} is not 1 to " +
          std::to_string(tile) + " rows within its sequence's query " + rows);
    }
    for (int r = it.row; r < it.row + it.rows; ++r)
      if (covered[r]++)
        throw std::runtime_error("Task 5.3 (tile_items): query row " + std::to_string(r) +
                                 " is in two work items");
  }
  for (size_t r = 0; r < covered.size(); ++r)
    if (!covered[r])
      throw std::runtime_error("Task 5.3 (tile_items): query row " + std::to_string(r) +
                               " is in no work item");
}

// With fewer than kMinItems (tile, KV head) items (a decode step of one or two requests:
// three items on two cores leave one core idle while the other finishes the third),
// one-row tiles become an item per chunk of their keys; the chunks' states are merged
// after, in order.
constexpr int kMinItems = 8;

// The tiles, with every row that `is_tree_row(tile, r)` names split off as a tile of one.
template <typename IsTreeRow>
std::vector<Tile> tree_tiles(const std::vector<Tile>& tiles, IsTreeRow is_tree_row) {
  std::vector<Tile> out;
  for (const Tile& t : tiles) {
    int run = 0;  // causal rows gathered so far, from t.row
    for (int r = 0; r < t.rows; ++r) {
      if (!is_tree_row(t, r)) {
        ++run;
        continue;
      }
      if (run > 0) out.push_back({t.seq, t.row + r - run, run});
      out.push_back({t.seq, t.row + r, 1});
      run = 0;
    }
    if (run > 0) out.push_back({t.seq, t.row + t.rows - run, run});
  }
  return out;
}

}  // namespace

// ANCHOR: cpu_work_items
// Work items: one per (tile of query rows, KV head), or per (one-row tile, KV head, chunk
// of keys); each walks only its own sequence's block table. Tiles of one row are the
// vector schedule.
template <typename T>
void paged_attention_cpu(const T* q, const T* k_pages, const T* v_pages, const int32_t* tables,
                         const int32_t* context_lens, const int32_t* qsl, T* out,
                         const CpuAttentionShape& g, const CpuTreeRows* tree) {
  ProfileScope profile(Phase::kAttention);
  std::vector<Tile> tiles = g.query_tile > 1 ? tile_items(qsl, g.num_seqs, g.query_tile)
                                             : row_items(qsl, g.num_seqs);
  check_items(tiles, qsl, g.num_seqs, std::max(1, g.query_tile));
  const int G = g.n_heads / g.n_kv_heads, D = g.head_dim, H = g.n_kv_heads;
  const int64_t row_elems = static_cast<int64_t>(g.n_heads) * D;
  auto first_pos = [&](const Tile& tile) {
    const int b = tile.seq;
    return context_lens[b] - (qsl[b + 1] - qsl[b]) + (tile.row - qsl[b]);
  };
  // A tree row sees other keys than its tile's causal walk: it is a tile of its own.
  auto in_tree = [&](int row, int pos) { return tree != nullptr && tree->start[row] <= pos; };
  if (tree != nullptr) tiles = tree_tiles(tiles, [&](const Tile& t, int r) {
    return in_tree(t.row + r, first_pos(t) + r);
  });
  // Each tile's items: one, or its chunks (split[t] > 0: their first partial state).
  const bool split = static_cast<int64_t>(tiles.size()) * H < kMinItems;
  std::vector<int> item_tile, item_chunk, split_first(tiles.size(), -1);
  double keys = 0;  // (query row, key) pairs, to size the job for the worker pool
  int partials = 0;
  for (size_t t = 0; t < tiles.size(); ++t) {
    const int num_keys = first_pos(tiles[t]) + tiles[t].rows;
    keys += double(num_keys) * tiles[t].rows;
    const int chunks = chunks_of(num_keys, g.page_size);
    if (split && tiles[t].rows == 1 && chunks > 1 && !in_tree(tiles[t].row, num_keys - 1)) {
      split_first[t] = partials;
      for (int c = 0; c < chunks; ++c) item_tile.push_back(t), item_chunk.push_back(c);
      partials += chunks;
    } else {
      item_tile.push_back(t), item_chunk.push_back(-1);
    }
  }
  // Partial states: [partial chunk][KV head][G] maxima and sums, then [G][D] acc.
  const int64_t state_floats = static_cast<int64_t>(G) * (D + 2);
  std::vector<float> partial(static_cast<size_t>(partials) * H * state_floats);
  auto states_of = [&](float* base) { return PairStates{base, base + G, base + 2 * G}; };
  const int items = static_cast<int>(item_tile.size()) * H;
  const double flops = 4.0 * g.n_heads * D * keys / std::max(1, items);
  parallel_for(items, flops, [&](int item) {
    const int i = item / H, h = item % H, c = item_chunk[i];
    const Tile& tile = tiles[item_tile[i]];
    const int pos = first_pos(tile), R = tile.rows * G;
    const int64_t offset = tile.row * row_elems + static_cast<int64_t>(h) * G * D;
    const int32_t* table = tables + static_cast<int64_t>(tile.seq) * g.max_pages;
    if (c >= 0) {  // one chunk, merged with the others below
      float* base = partial.data() + ((split_first[item_tile[i]] + c) * H + h) * state_floats;
      std::fill(base + G, base + 2 * G + G * D, 0.0f);  // l = 0: no keys yet
      attend_chunks(q + offset, 1, pos, k_pages, v_pages, table, h, G, c, c + 1, g,
                    states_of(base));
      return;
    }
    thread_local std::vector<float> total;
    total.assign(static_cast<size_t>(R) * (D + 2), 0.0f);
    const PairStates st{total.data(), total.data() + R, total.data() + 2 * R};
    if (tile.rows == 1 && in_tree(tile.row, pos)) {
      attend_tree_row(q + offset, tree->start[tile.row], tree->mask[tile.row], k_pages, v_pages,
                      table, h, G, g, st);
    } else {
      attend_chunks(q + offset, tile.rows, pos, k_pages, v_pages, table, h, G, 0,
                    chunks_of(pos + tile.rows, g.page_size), g, st);
    }
    write_rows(st, tile.rows, G, g, out + offset);
  });
  std::vector<float> merged(static_cast<size_t>(state_floats));
  for (size_t t = 0; t < tiles.size(); ++t) {
    if (split_first[t] < 0) continue;
    const int chunks = chunks_of(first_pos(tiles[t]) + 1, g.page_size);
    for (int h = 0; h < H; ++h) {
      std::fill(merged.begin(), merged.end(), 0.0f);
      for (int c = 0; c < chunks; ++c)
        merge_chunk(states_of(merged.data()),
                    states_of(partial.data() + ((split_first[t] + c) * H + h) * state_floats),
                    G, D);
      write_rows(states_of(merged.data()), 1, G, g,
                 out + tiles[t].row * row_elems + static_cast<int64_t>(h) * G * D);
    }
  }
}
// ANCHOR_END: cpu_work_items

template void paged_attention_cpu<float>(const float*, const float*, const float*,
                                         const int32_t*, const int32_t*, const int32_t*, float*,
                                         const CpuAttentionShape&, const CpuTreeRows*);
template void paged_attention_cpu<mlx::core::float16_t>(
    const mlx::core::float16_t*, const mlx::core::float16_t*, const mlx::core::float16_t*,
    const int32_t*, const int32_t*, const int32_t*, mlx::core::float16_t*,
    const CpuAttentionShape&, const CpuTreeRows*);
template void paged_attention_cpu<mlx::core::bfloat16_t>(
    const mlx::core::bfloat16_t*, const mlx::core::bfloat16_t*, const mlx::core::bfloat16_t*,
    const int32_t*, const int32_t*, const int32_t*, mlx::core::bfloat16_t*,
    const CpuAttentionShape&, const CpuTreeRows*);

}  // namespace tiny_llm
