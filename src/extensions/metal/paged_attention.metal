// Paged attention on Apple GPUs: the vector decode schedule (Day 4) and the tiled
// FlashAttention schedule (Day 5) behind one block-table interface.
//
// Vector schedule: one threadgroup per (query row, KV head); 8 simdgroups of 32 lanes.
// Simdgroup s walks logical pages s, s + 8, s + 16, ... of the row's sequence through the
// block table; its lanes split the head dimension, so a dot product is a per-lane partial
// plus simd_sum. Each simdgroup keeps an online softmax (m, l, acc) for the GROUP query
// heads that share the KV head, so every K/V row is loaded once for the whole group. At
// the end the simdgroups' partial states are merged through threadgroup memory.
//
// There are no [[kernel]] functions here: the host (src/extensions/metal_launch.cpp) gives
// MLX's JIT (fast::metal_kernel) this file as the header and a body that calls one of the
// *_entry functions at the end; MLX writes the [[kernel]] signature around that body.
// Launch geometry and the threadgroup-memory layout come from paged_attention_geometry.h,
// which the host includes too.
//
// Written in the MSL subset that tools/metal_emulator compiles as C++ (see its README):
// the emulator runs the exact source the host hands to MLX.
#include <metal_stdlib>
#ifndef TINY_LLM_PAGED_ATTENTION_GEOMETRY  // the host inlines it ahead of this file
#include "paged_attention_geometry.h"
#endif
using namespace metal;
using namespace paged_geometry;

// A course stub (tiny_llm/course/tasks.py) in place of a task's code. The host refuses to launch
// a kernel that holds one; the emulator stops with the task's message.
#ifndef TINY_LLM_TASK_STUB
#define TINY_LLM_TASK_STUB(message)
#endif

// Rows of a token tree (speculative decoding; tree_start and tree_mask as the CPU kernels
// take them, or null where every row is causal): row `row`, whose own key is `own_key`,
// sees the keys before tree_start[row] and, of the keys tree_start[row] + j, those whose
// bit j of tree_mask[row] is set. Both kernels give such a row the vector schedule.
inline bool in_tree(const device int* tree_start, int row, int own_key) {
  return tree_start != nullptr && tree_start[row] <= own_key;
}

// ANCHOR: metal_vector_schedule
template <typename T, int HEAD_DIM, int GROUP>
void paged_attention_impl(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
    const device int* tree_start,
    const device uint64_t* tree_mask,
    device T* out,
    int num_seqs,
    int max_pages,
    int n_heads,
    int n_kv_heads,
    int page_size,
    float scale,
    threadgroup float* tg_m,
    threadgroup float* tg_l,
    threadgroup float* tg_acc,
    uint row,
    uint kv_head,
    uint sg,
    uint lane) {
  constexpr int PER_LANE = (HEAD_DIM + 31) / 32;
  int b = 0;
  while (b + 1 < num_seqs && query_start_loc[b + 1] <= int(row)) {
    b += 1;
  }
  const int query_len = query_start_loc[b + 1] - query_start_loc[b];
  const int own_key = context_lens[b] - query_len + (int(row) - query_start_loc[b]);
  // A row of a token tree walks the keys before its tree's first draft (as the causal row
  // just before them would), then folds in the drafts its mask names, after the walk.
  const bool tree_row = in_tree(tree_start, int(row), own_key);
  const int tree_first = tree_row ? max(tree_start[row], 0) : own_key + 1;
  const int num_keys = tree_first;
  const int slot_stride = n_kv_heads * HEAD_DIM;

  float qr[GROUP][PER_LANE];
  float acc[GROUP][PER_LANE];
  float m[GROUP];
  float l[GROUP];
  for (int g = 0; g < GROUP; ++g) {
    const int head = int(kv_head) * GROUP + g;
    for (int i = 0; i < PER_LANE; ++i) {
      const int d = int(lane) + 32 * i;
      qr[g][i] = d < HEAD_DIM ? float(q[(int(row) * n_heads + head) * HEAD_DIM + d]) * scale : 0.0f;
      acc[g][i] = 0.0f;
    }
    m[g] = -FLT_MAX;
    l[g] = 0.0f;
  }

  const int num_pages = (num_keys + page_size - 1) / page_size;
  // TASK 4.4: paged_attention_impl, the page walk — The vector schedule on Apple GPUs
  for (int j = int(sg); j < num_pages; j += kSimdgroups) {
    // Address translation: logical page j lives in physical page block_table[b, j].
    const int page = block_table[b * max_pages + j];
    const int n = min(page_size, num_keys - j * page_size);
    for (int t = 0; t < n; ++t) {
      // 64-bit: one layer's pool can hold more than 2^31 elements.
      const long base = (long(page) * page_size + t) * slot_stride + long(kv_head) * HEAD_DIM;
      float kr[PER_LANE];
      float vr[PER_LANE];
      for (int i = 0; i < PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        kr[i] = d < HEAD_DIM ? float(k_pages[base + d]) : 0.0f;
        vr[i] = d < HEAD_DIM ? float(v_pages[base + d]) : 0.0f;
      }
      for (int g = 0; g < GROUP; ++g) {
        float partial = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
          partial += qr[g][i] * kr[i];
        }
        const float score = simd_sum(partial);
        const float new_m = max(m[g], score);
        const float correction = exp(m[g] - new_m);
        const float p = exp(score - new_m);
        l[g] = l[g] * correction + p;
        for (int i = 0; i < PER_LANE; ++i) {
          acc[g][i] = acc[g][i] * correction + p * vr[i];
        }
        m[g] = new_m;
      }
    }
  }
  // END TASK

  if (tree_row) {
    // Draft i of the row's tree (key tree_first + i, never past the row's own key) is
    // simdgroup i % 8's to fold, if bit i of the row's mask is set: the merge below sees
    // its state as it sees the walk's.
    const uint64_t mask = tree_mask[row];
    for (int draft = int(sg); draft < 64 && tree_first + draft <= own_key; draft += kSimdgroups) {
      if (((mask >> uint64_t(draft)) & 1) == 0) {
        continue;
      }
      const int key = tree_first + draft;
      const int page = block_table[b * max_pages + key / page_size];
      const long base =
          (long(page) * page_size + key % page_size) * slot_stride + long(kv_head) * HEAD_DIM;
      for (int g = 0; g < GROUP; ++g) {
        float partial = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
          const int d = int(lane) + 32 * i;
          partial += d < HEAD_DIM ? qr[g][i] * float(k_pages[base + d]) : 0.0f;
        }
        const float score = simd_sum(partial);
        const float new_m = max(m[g], score);
        const float correction = exp(m[g] - new_m);
        const float p = exp(score - new_m);
        l[g] = l[g] * correction + p;
        for (int i = 0; i < PER_LANE; ++i) {
          const int d = int(lane) + 32 * i;
          acc[g][i] = acc[g][i] * correction + (d < HEAD_DIM ? p * float(v_pages[base + d]) : 0.0f);
        }
        m[g] = new_m;
      }
    }
  }

  // Merge the simdgroups' softmax states: global max, rescaled sums and outputs.
  if (lane == 0) {
    for (int g = 0; g < GROUP; ++g) {
      tg_m[int(sg) * GROUP + g] = m[g];
      tg_l[int(sg) * GROUP + g] = l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float factor[GROUP];
  float total[GROUP];
  for (int g = 0; g < GROUP; ++g) {
    float global_m = -FLT_MAX;
    for (int s = 0; s < kSimdgroups; ++s) {
      global_m = max(global_m, tg_m[s * GROUP + g]);
    }
    total[g] = 0.0f;
    for (int s = 0; s < kSimdgroups; ++s) {
      total[g] += tg_l[s * GROUP + g] * exp(tg_m[s * GROUP + g] - global_m);
    }
    factor[g] = exp(m[g] - global_m);
  }
  for (int s = 0; s < kSimdgroups; ++s) {
    if (int(sg) == s) {
      for (int g = 0; g < GROUP; ++g) {
        for (int i = 0; i < PER_LANE; ++i) {
          const int d = int(lane) + 32 * i;
          if (d < HEAD_DIM) {
            const float prev = s == 0 ? 0.0f : tg_acc[g * HEAD_DIM + d];
            tg_acc[g * HEAD_DIM + d] = prev + acc[g][i] * factor[g];
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (sg == 0) {
    for (int g = 0; g < GROUP; ++g) {
      const int head = int(kv_head) * GROUP + g;
      for (int i = 0; i < PER_LANE; ++i) {
        const int d = int(lane) + 32 * i;
        if (d < HEAD_DIM) {
          out[(int(row) * n_heads + head) * HEAD_DIM + d] = T(tg_acc[g * HEAD_DIM + d] / total[g]);
        }
      }
    }
  }
}
// ANCHOR_END: metal_vector_schedule

// ANCHOR: metal_flash_schedule
// The tiled (FlashAttention) schedule for rows of multi-token queries. A threadgroup
// takes one query tile of sequence b for one KV head: kTilePairs (row, head) pairs, 8 per
// simdgroup, so the GROUP heads sharing the KV head share every K/V tile. Keys come in
// tiles of kKeyTile (a tile never straddles a page: page_size is a multiple of it): the
// whole threadgroup stages a tile in threadgroup memory once, then each simdgroup computes
// S = Q K^T with simdgroup_matrix 8x8 multiplies, folds S into its online softmax (one
// lane per pair), and accumulates O += P V. Key tiles past the tile's last row are never
// loaded: tiles above the causal diagonal are skipped.

template <typename T, int HEAD_DIM, int GROUP>
void paged_flash_impl(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
    const device int* tree_start,
    device T* out,
    int b,
    int tile,
    int max_pages,
    int n_heads,
    int n_kv_heads,
    int page_size,
    float scale,
    threadgroup float* k_tile,
    threadgroup float* v_tile,
    threadgroup float* scratch,
    threadgroup float* row_l,
    uint kv_head,
    uint sg,
    uint lane,
    uint tid) {
  constexpr int CHUNKS = HEAD_DIM / 8;
  constexpr int TILE_ROWS = tile_rows(GROUP);
  const int seq_start = query_start_loc[b];
  const int query_len = query_start_loc[b + 1] - seq_start;
  const int first_pos = context_lens[b] - query_len;  // position of the sequence's row 0
  const int tile_row0 = tile * TILE_ROWS;
  const int rows_in_tile = min(TILE_ROWS, query_len - tile_row0);
  const int num_keys = first_pos + tile_row0 + rows_in_tile;  // keys the last row sees
  const int slot_stride = n_kv_heads * HEAD_DIM;
  threadgroup float* my_scratch = scratch + int(sg) * kPairsPerSimdgroup * kKeyTile;

  // This lane's pair (lanes 0..7 own the softmax state of pair sg*8 + lane).
  const int my_pair = int(sg) * kPairsPerSimdgroup + int(lane);
  const int my_row = my_pair / GROUP;
  const bool my_valid = lane < kPairsPerSimdgroup && my_row < rows_in_tile;
  const int my_pos = first_pos + tile_row0 + my_row;
  float m = -FLT_MAX;
  float l = 0.0f;

  // Q block of this simdgroup: 8 pairs x HEAD_DIM, staged chunk by chunk.
  simdgroup_matrix<float, 8, 8> qm[CHUNKS];
  simdgroup_matrix<float, 8, 8> om[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) {
    for (int e = int(lane); e < 64; e += 32) {
      const int pair = int(sg) * 8 + e / 8;
      const int row = pair / GROUP;
      const int head = int(kv_head) * GROUP + pair % GROUP;
      const int flat = seq_start + tile_row0 + row;
      my_scratch[e] = row < rows_in_tile
          ? float(q[(flat * n_heads + head) * HEAD_DIM + c * 8 + e % 8]) * scale
          : 0.0f;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_load(qm[c], my_scratch, 8);
    om[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }

  // TASK 5.4: paged_flash_impl, the key-tile loop — Tiles on Apple GPUs
  for (int key0 = 0; key0 < num_keys; key0 += kKeyTile) {
    // Stage the key tile: 8 keys x HEAD_DIM of K and V, zeros past the last key.
    const int page = block_table[b * max_pages + key0 / page_size];
    for (int e = int(tid); e < kKeyTile * HEAD_DIM; e += kThreadsPerThreadgroup) {
      const int t = e / HEAD_DIM;
      const int d = e % HEAD_DIM;
      const long offset = (long(page) * page_size + key0 % page_size + t) * slot_stride +
          long(kv_head) * HEAD_DIM + d;
      const bool in_range = key0 + t < num_keys;
      k_tile[e] = in_range ? float(k_pages[offset]) : 0.0f;
      v_tile[e] = in_range ? float(v_pages[offset]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    simdgroup_matrix<float, 8, 8> s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int c = 0; c < CHUNKS; ++c) {
      simdgroup_matrix<float, 8, 8> kt;
      // K^T chunk: the chunk's own origin, so that no rule for where a transposed load
      // applies its origin is needed.
      simdgroup_load(kt, k_tile + c * 8, HEAD_DIM, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(s, qm[c], kt, s);
    }
    simdgroup_store(s, my_scratch, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // Online softmax for this lane's pair; P back into scratch, the rescale on a diagonal.
    float correction = 1.0f;
    if (lane < 8) {
      float tile_max = -FLT_MAX;
      for (int j = 0; j < 8; ++j) {
        const bool visible = my_valid && key0 + j <= my_pos;
        tile_max = visible ? max(tile_max, my_scratch[lane * 8 + j]) : tile_max;
      }
      const float new_m = max(m, tile_max);
      correction = exp(m - new_m);
      l *= correction;
      for (int j = 0; j < 8; ++j) {
        const bool visible = my_valid && key0 + j <= my_pos;
        const float p = visible ? exp(my_scratch[lane * 8 + j] - new_m) : 0.0f;
        my_scratch[lane * 8 + j] = p;
        l += p;
      }
      m = new_m;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<float, 8, 8> pm;
    simdgroup_load(pm, my_scratch, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(lane); e < 64; e += 32) {
      my_scratch[e] = 0.0f;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (lane < 8) {
      my_scratch[lane * 9] = correction;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<float, 8, 8> diag;
    simdgroup_load(diag, my_scratch, 8);
    for (int c = 0; c < CHUNKS; ++c) {
      simdgroup_matrix<float, 8, 8> vm;
      simdgroup_load(vm, v_tile + c * 8, HEAD_DIM);
      simdgroup_multiply(om[c], diag, om[c]);
      simdgroup_multiply_accumulate(om[c], pm, vm, om[c]);
    }
    // Everyone is done with this key tile before the next one overwrites it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // END TASK

  if (lane < 8) {
    row_l[my_pair] = l;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int c = 0; c < CHUNKS; ++c) {
    simdgroup_store(om[c], my_scratch, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(lane); e < 64; e += 32) {
      const int pair = int(sg) * 8 + e / 8;
      const int row = pair / GROUP;
      const int flat = seq_start + tile_row0 + row;
      // A tree row's output is its vector threadgroup's (see paged_attention_flash_entry).
      if (row < rows_in_tile && !in_tree(tree_start, flat, first_pos + tile_row0 + row)) {
        const int head = int(kv_head) * GROUP + pair % GROUP;
        out[(flat * n_heads + head) * HEAD_DIM + c * 8 + e % 8] = T(my_scratch[e] / row_l[pair]);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}
// ANCHOR_END: metal_flash_schedule

// ANCHOR: metal_dispatch
// The host's params buffer (int32, see kParam* in paged_attention_geometry.h).
struct PagedParams {
  int num_seqs;
  int max_pages;
  int n_heads;
  int n_kv_heads;
  int page_size;
  float scale;
};

inline PagedParams read_params(const device int* params) {
  PagedParams p;
  p.num_seqs = params[kParamNumSeqs];
  p.max_pages = params[kParamMaxPages];
  p.n_heads = params[kParamNHeads];
  p.n_kv_heads = params[kParamNKvHeads];
  p.page_size = params[kParamPageSize];
  p.scale = as_type<float>(params[kParamScaleBits]);
  return p;
}

// Day 4's kernel: the vector schedule for every query row, whatever its sequence's query
// length (a multi-token query is just several rows, each walking its own causal range).
// Grid: one threadgroup per (query row, KV head).
template <typename T, int HEAD_DIM, int GROUP>
void paged_attention_vector_entry(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
    const device int* params,
    const device int* tree_start,
    const device uint64_t* tree_mask,
    device T* out,
    threadgroup float* tg_memory,
    uint3 tg_pos,
    uint sg,
    uint lane) {
  const PagedParams p = read_params(params);
  paged_attention_impl<T, HEAD_DIM, GROUP>(
      q, k_pages, v_pages, block_table, context_lens, query_start_loc, tree_start, tree_mask,
      out, p.num_seqs,
      p.max_pages, p.n_heads, p.n_kv_heads, p.page_size, p.scale, tg_memory,
      tg_memory + offset_simd_sums(GROUP), tg_memory + offset_accumulator(GROUP), tg_pos.x,
      tg_pos.y, sg, lane);
}

// Day 5's kernel: one dispatch serves a mixed batch. Threadgroup x < T takes query row x
// with the vector schedule if its sequence has a single query (or the row is a token
// tree's: its keys are not the causal range a tile assumes); the threadgroups after
// those take (sequence, query tile) pairs with the tiled schedule if the sequence has
// several (tiles_per_sequence per sequence, as the host sized the grid). The choice is
// uniform per threadgroup, so every barrier is reached by all its threads.
template <typename T, int HEAD_DIM, int GROUP>
void paged_attention_flash_entry(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
    const device int* params,
    const device int* tree_start,
    const device uint64_t* tree_mask,
    device T* out,
    threadgroup float* tg_memory,
    uint3 tg_pos,
    uint sg,
    uint lane,
    uint tid) {
  const PagedParams p = read_params(params);
  const int total_rows = query_start_loc[p.num_seqs];
  const int x = int(tg_pos.x);
  if (x < total_rows) {
    int b = 0;
    while (b + 1 < p.num_seqs && query_start_loc[b + 1] <= x) {
      b += 1;
    }
    const int query_len = query_start_loc[b + 1] - query_start_loc[b];
    const int own_key = context_lens[b] - query_len + (x - query_start_loc[b]);
    if (query_len == 1 || in_tree(tree_start, x, own_key)) {
      paged_attention_impl<T, HEAD_DIM, GROUP>(
          q, k_pages, v_pages, block_table, context_lens, query_start_loc, tree_start,
          tree_mask, out, p.num_seqs,
          p.max_pages, p.n_heads, p.n_kv_heads, p.page_size, p.scale, tg_memory,
          tg_memory + offset_simd_sums(GROUP), tg_memory + offset_accumulator(GROUP), tg_pos.x,
          tg_pos.y, sg, lane);
    }
  } else {
    const int tiles_per_seq = tiles_per_sequence(total_rows, GROUP);
    const int b = (x - total_rows) / tiles_per_seq;
    const int tile = (x - total_rows) % tiles_per_seq;
    if (b < p.num_seqs) {
      const int query_len = query_start_loc[b + 1] - query_start_loc[b];
      if (query_len > 1 && tile * tile_rows(GROUP) < query_len) {
        paged_flash_impl<T, HEAD_DIM, GROUP>(
            q, k_pages, v_pages, block_table, context_lens, query_start_loc, tree_start, out,
            b, tile,
            p.max_pages, p.n_heads, p.n_kv_heads, p.page_size, p.scale,
            tg_memory + offset_k_tile(GROUP, HEAD_DIM), tg_memory + offset_v_tile(GROUP, HEAD_DIM),
            tg_memory + offset_scratch(GROUP, HEAD_DIM), tg_memory, tg_pos.y, sg, lane, tid);
      }
    }
  }
}
// ANCHOR_END: metal_dispatch
