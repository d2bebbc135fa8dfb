// Paged attention on Apple GPUs: the vector decode schedule and the tiled
// (FlashAttention) schedule behind one dispatch.
//
// One threadgroup per (query row, KV head); 8 simdgroups of 32 lanes. Simdgroup s walks
// logical pages s, s + 8, s + 16, ... of the row's sequence through the block table; its
// lanes split the head dimension, so a dot product is a per-lane partial plus simd_sum.
// Each simdgroup keeps an online softmax (m, l, acc) for the GROUP query heads that share
// the KV head, so every K/V row is loaded once for the whole group. At the end the
// simdgroups' partial states are merged through threadgroup memory.
//
// Written in the MSL subset that tools/metal_emulator compiles as C++ (see its README):
// this file is used unchanged by MLX's JIT (fast::metal_kernel, as a header), by
// `xcrun metal -c` (make metal-check) and by the emulator tests.
#include <metal_stdlib>
using namespace metal;

constant constexpr int kSimdgroups = 8;

struct PagedAttentionParams {
  int num_seqs;
  int max_pages;
  int n_heads;
  int n_kv_heads;
  int page_size;
  float scale;
};

// ANCHOR: metal_vector_schedule
template <typename T, int HEAD_DIM, int GROUP>
void paged_attention_impl(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
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
  const int num_keys = context_lens[b] - query_len + (int(row) - query_start_loc[b]) + 1;
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
// takes one query tile of sequence b for one KV head: 64 (row, head) pairs, 8 per
// simdgroup, so the GROUP heads sharing the KV head share every K/V tile. Keys come in
// tiles of 8 (a tile never straddles a page: page_size is a multiple of 8): the whole
// threadgroup stages a tile in threadgroup memory once, then each simdgroup computes
// S = Q K^T with simdgroup_matrix 8x8 multiplies, folds S into its online softmax (one
// lane per pair), and accumulates O += P V. Key tiles past the tile's last row are never
// loaded: tiles above the causal diagonal are skipped.
constant constexpr int kPairs = 8 * kSimdgroups;

// Floats of per-pair softmax state: the vector schedule's merge needs kSimdgroups * GROUP,
// the tiled schedule's row sums kPairs; the two never run in one threadgroup.
constexpr int state_floats(int group) {
  return kPairs > kSimdgroups * group ? kPairs : kSimdgroups * group;
}

template <typename T, int HEAD_DIM, int GROUP>
void paged_flash_impl(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
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
  constexpr int TILE_ROWS = kPairs / GROUP;
  const int seq_start = query_start_loc[b];
  const int query_len = query_start_loc[b + 1] - seq_start;
  const int first_pos = context_lens[b] - query_len;  // position of the sequence's row 0
  const int tile_row0 = tile * TILE_ROWS;
  const int tile_rows = min(TILE_ROWS, query_len - tile_row0);
  const int num_keys = first_pos + tile_row0 + tile_rows;  // keys the last row sees
  const int slot_stride = n_kv_heads * HEAD_DIM;
  threadgroup float* my_scratch = scratch + int(sg) * 64;

  // This lane's pair (lanes 0..7 own the softmax state of pair sg*8 + lane).
  const int my_pair = int(sg) * 8 + int(lane);
  const int my_row = my_pair / GROUP;
  const bool my_valid = lane < 8 && my_row < tile_rows;
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
      my_scratch[e] = row < tile_rows
          ? float(q[(flat * n_heads + head) * HEAD_DIM + c * 8 + e % 8]) * scale
          : 0.0f;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_load(qm[c], my_scratch, 8);
    om[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int key0 = 0; key0 < num_keys; key0 += 8) {
    // Stage the key tile: 8 keys x HEAD_DIM of K and V, zeros past the last key.
    const int page = block_table[b * max_pages + key0 / page_size];
    for (int e = int(tid); e < 8 * HEAD_DIM; e += 32 * kSimdgroups) {
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
      simdgroup_load(kt, k_tile, HEAD_DIM, ulong2(c * 8, 0), true);  // K^T chunk
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
      simdgroup_load(vm, v_tile, HEAD_DIM, ulong2(c * 8, 0));
      simdgroup_multiply(om[c], diag, om[c]);
      simdgroup_multiply_accumulate(om[c], pm, vm, om[c]);
    }
    // Everyone is done with this key tile before the next one overwrites it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

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
      if (row < tile_rows) {
        const int head = int(kv_head) * GROUP + pair % GROUP;
        const int flat = seq_start + tile_row0 + row;
        out[(flat * n_heads + head) * HEAD_DIM + c * 8 + e % 8] = T(my_scratch[e] / row_l[pair]);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}
// ANCHOR_END: metal_flash_schedule

// ANCHOR: metal_dispatch
// One dispatch serves a mixed batch: threadgroup x < T takes query row x with the vector
// schedule if its sequence has a single query; the threadgroups after those take
// (sequence, query tile) pairs with the tiled schedule if the sequence has several.
// The choice is uniform per threadgroup, so every barrier is reached by all its threads.
template <typename T, int HEAD_DIM, int GROUP>
void paged_attention_dispatch(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
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
    threadgroup float* k_tile,
    threadgroup float* v_tile,
    threadgroup float* scratch,
    uint3 tg_pos,
    uint3 num_groups,
    uint sg,
    uint lane,
    uint tid) {
  const int total_rows = query_start_loc[num_seqs];
  const int x = int(tg_pos.x);
  if (x < total_rows) {
    int b = 0;
    while (b + 1 < num_seqs && query_start_loc[b + 1] <= x) {
      b += 1;
    }
    if (query_start_loc[b + 1] - query_start_loc[b] == 1) {
      paged_attention_impl<T, HEAD_DIM, GROUP>(
          q, k_pages, v_pages, block_table, context_lens, query_start_loc, out, num_seqs,
          max_pages, n_heads, n_kv_heads, page_size, scale, tg_m, tg_l, tg_acc, tg_pos.x,
          tg_pos.y, sg, lane);
    }
  } else {
    const int tiles_per_seq = (int(num_groups.x) - total_rows) / num_seqs;
    const int b = (x - total_rows) / tiles_per_seq;
    const int tile = (x - total_rows) % tiles_per_seq;
    const int query_len = query_start_loc[b + 1] - query_start_loc[b];
    if (query_len > 1 && tile * (kPairs / GROUP) < query_len) {
      paged_flash_impl<T, HEAD_DIM, GROUP>(
          q, k_pages, v_pages, block_table, context_lens, query_start_loc, out, b, tile,
          max_pages, n_heads, n_kv_heads, page_size, scale, k_tile, v_tile, scratch, tg_m,
          tg_pos.y, sg, lane, tid);
    }
  }
}
// ANCHOR_END: metal_dispatch

// The full op as a kernel with an explicit signature, for `xcrun metal -c` and the
// emulator: grid = (T + num_seqs * tiles_per_seq) x n_kv_heads threadgroups of 256.
template <typename T, int HEAD_DIM, int GROUP>
[[kernel]] void paged_attention(
    const device T* q [[buffer(0)]],
    const device T* k_pages [[buffer(1)]],
    const device T* v_pages [[buffer(2)]],
    const device int* block_table [[buffer(3)]],
    const device int* context_lens [[buffer(4)]],
    const device int* query_start_loc [[buffer(5)]],
    device T* out [[buffer(6)]],
    constant PagedAttentionParams& p [[buffer(7)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint3 num_groups [[threadgroups_per_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tg_m[state_floats(GROUP)];
  threadgroup float tg_l[kSimdgroups * GROUP];
  threadgroup float tg_acc[GROUP * HEAD_DIM];
  threadgroup float k_tile[8 * HEAD_DIM];
  threadgroup float v_tile[8 * HEAD_DIM];
  threadgroup float scratch[64 * kSimdgroups];
  paged_attention_dispatch<T, HEAD_DIM, GROUP>(
      q, k_pages, v_pages, block_table, context_lens, query_start_loc, out, p.num_seqs,
      p.max_pages, p.n_heads, p.n_kv_heads, p.page_size, p.scale, tg_m, tg_l, tg_acc, k_tile,
      v_tile, scratch, tg_pos, num_groups, sg, lane, tid);
}

// Entry used by MLX's JIT (fast::metal_kernel generates the kernel signature; the body it
// runs declares threadgroup memory and calls this). Params: num_seqs, max_pages, n_heads,
// n_kv_heads, page_size, bits of the float scale.
template <typename T, int HEAD_DIM, int GROUP>
void paged_attention_jit_entry(
    const device T* q,
    const device T* k_pages,
    const device T* v_pages,
    const device int* block_table,
    const device int* context_lens,
    const device int* query_start_loc,
    const device int* params,
    device T* out,
    threadgroup float* tg_m,
    threadgroup float* tg_l,
    threadgroup float* tg_acc,
    threadgroup float* k_tile,
    threadgroup float* v_tile,
    threadgroup float* scratch,
    uint3 tg_pos,
    uint3 num_groups,
    uint sg,
    uint lane,
    uint tid) {
  paged_attention_dispatch<T, HEAD_DIM, GROUP>(
      q, k_pages, v_pages, block_table, context_lens, query_start_loc, out, params[0],
      params[1], params[2], params[3], params[4], as_type<float>(params[5]), tg_m, tg_l,
      tg_acc, k_tile, v_tile, scratch, tg_pos, num_groups, sg, lane, tid);
}

// The vector schedule alone as a kernel with an explicit signature (every row, whatever
// its query length), for `xcrun metal -c` and the emulator.
template <typename T, int HEAD_DIM, int GROUP>
[[kernel]] void paged_attention_decode(
    const device T* q [[buffer(0)]],
    const device T* k_pages [[buffer(1)]],
    const device T* v_pages [[buffer(2)]],
    const device int* block_table [[buffer(3)]],
    const device int* context_lens [[buffer(4)]],
    const device int* query_start_loc [[buffer(5)]],
    device T* out [[buffer(6)]],
    constant PagedAttentionParams& p [[buffer(7)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tg_m[kSimdgroups * GROUP];
  threadgroup float tg_l[kSimdgroups * GROUP];
  threadgroup float tg_acc[GROUP * HEAD_DIM];
  paged_attention_impl<T, HEAD_DIM, GROUP>(
      q, k_pages, v_pages, block_table, context_lens, query_start_loc, out, p.num_seqs,
      p.max_pages, p.n_heads, p.n_kv_heads, p.page_size, p.scale, tg_m, tg_l, tg_acc,
      tg_pos.x, tg_pos.y, sg, lane);
}

template [[host_name("paged_attention_decode_float_64_3")]] [[kernel]]
decltype(paged_attention_decode<float, 64, 3>) paged_attention_decode<float, 64, 3>;
template [[host_name("paged_attention_decode_float_128_4")]] [[kernel]]
decltype(paged_attention_decode<float, 128, 4>) paged_attention_decode<float, 128, 4>;
template [[host_name("paged_attention_decode_half_64_1")]] [[kernel]]
decltype(paged_attention_decode<half, 64, 1>) paged_attention_decode<half, 64, 1>;
template [[host_name("paged_attention_decode_float_96_8")]] [[kernel]]
decltype(paged_attention_decode<float, 96, 8>) paged_attention_decode<float, 96, 8>;
template [[host_name("paged_attention_decode_float_64_1")]] [[kernel]]
decltype(paged_attention_decode<float, 64, 1>) paged_attention_decode<float, 64, 1>;
template [[host_name("paged_attention_decode_half_128_4")]] [[kernel]]
decltype(paged_attention_decode<half, 128, 4>) paged_attention_decode<half, 128, 4>;
template [[host_name("paged_attention_float_64_3")]] [[kernel]]
decltype(paged_attention<float, 64, 3>) paged_attention<float, 64, 3>;
template [[host_name("paged_attention_float_128_4")]] [[kernel]]
decltype(paged_attention<float, 128, 4>) paged_attention<float, 128, 4>;
template [[host_name("paged_attention_half_64_1")]] [[kernel]]
decltype(paged_attention<half, 64, 1>) paged_attention<half, 64, 1>;
template [[host_name("paged_attention_float_96_8")]] [[kernel]]
decltype(paged_attention<float, 96, 8>) paged_attention<float, 96, 8>;
template [[host_name("paged_attention_float_64_1")]] [[kernel]]
decltype(paged_attention<float, 64, 1>) paged_attention<float, 64, 1>;
template [[host_name("paged_attention_half_128_4")]] [[kernel]]
decltype(paged_attention<half, 128, 4>) paged_attention<half, 128, 4>;
