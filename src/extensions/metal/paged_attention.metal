// Paged attention on Apple GPUs: the vector decode schedule.
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
      const int base = (page * page_size + t) * slot_stride + int(kv_head) * HEAD_DIM;
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
    uint3 tg_pos,
    uint sg,
    uint lane) {
  paged_attention_impl<T, HEAD_DIM, GROUP>(
      q, k_pages, v_pages, block_table, context_lens, query_start_loc, out, params[0],
      params[1], params[2], params[3], params[4], as_type<float>(params[5]), tg_m, tg_l,
      tg_acc, tg_pos.x, tg_pos.y, sg, lane);
}

// A complete kernel with an explicit signature, for `xcrun metal -c` and the emulator.
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
