// A tiny paged decode attention: one simdgroup per (sequence, query head)
// walks the sequence's keys through its block table, two passes (max, then
// softmax-weighted sum of V). Shapes follow the block-table interface (book: architecture):
//   q            [B, Hq, D]
//   k_pages      [P, page_size, Hkv, D]   (v_pages alike)
//   block_table  [B, max_pages] int32, unused entries -1 (never read)
//   context_lens [B] int32 (>= 1)
//   out          [B, Hq, D]
// Grid: threadgroups (Hq, B), 32 threads each. Query head h reads KV head
// h / (Hq / Hkv).
#include <metal_stdlib>
using namespace metal;

struct DecodeParams {
  int num_heads;
  int num_kv_heads;
  int max_pages;
  int page_size;
  float scale;
};

// Row of key/value position t of sequence b for KV head kvh.
template <typename T, int D>
const device T* kv_row(const device T* pages, const device int* block_table, constant DecodeParams& p,
                       int b, int t, int kvh) {
  const int page = block_table[b * p.max_pages + t / p.page_size];
  const int slot = t % p.page_size;
  return pages + ((page * p.page_size + slot) * p.num_kv_heads + kvh) * D;
}

template <typename T, int D>
[[kernel]] void paged_decode(
    const device T* q [[buffer(0)]],
    const device T* k_pages [[buffer(1)]],
    const device T* v_pages [[buffer(2)]],
    const device int* block_table [[buffer(3)]],
    const device int* context_lens [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant DecodeParams& p [[buffer(6)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const int h = group.x;
  const int b = group.y;
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const int ctx = context_lens[b];
  const device T* qv = q + (b * p.num_heads + h) * D;

  float m = -FLT_MAX;
  for (int t = lane; t < ctx; t += 32) {
    const device T* k = kv_row<T, D>(k_pages, block_table, p, b, t, kvh);
    float s = 0.0f;
    for (int d = 0; d < D; ++d) {
      s += float(qv[d]) * float(k[d]);
    }
    m = max(m, s * p.scale);
  }
  m = simd_max(m);

  float l = 0.0f;
  float acc[D];
  for (int d = 0; d < D; ++d) {
    acc[d] = 0.0f;
  }
  for (int t = lane; t < ctx; t += 32) {
    const device T* k = kv_row<T, D>(k_pages, block_table, p, b, t, kvh);
    const device T* v = kv_row<T, D>(v_pages, block_table, p, b, t, kvh);
    float s = 0.0f;
    for (int d = 0; d < D; ++d) {
      s += float(qv[d]) * float(k[d]);
    }
    const float w = exp(s * p.scale - m);
    l += w;
    for (int d = 0; d < D; ++d) {
      acc[d] += w * float(v[d]);
    }
  }
  l = simd_sum(l);
  for (int d = 0; d < D; ++d) {
    const float o = simd_sum(acc[d]);
    if (lane == 0) {
      out[(b * p.num_heads + h) * D + d] = T(o / l);
    }
  }
}

template [[host_name("paged_decode_float_32")]] [[kernel]] decltype(paged_decode<float, 32>) paged_decode<float, 32>;
template [[host_name("paged_decode_half_32")]] [[kernel]] decltype(paged_decode<half, 32>) paged_decode<half, 32>;
template [[host_name("paged_decode_bfloat_32")]] [[kernel]] decltype(paged_decode<bfloat, 32>) paged_decode<bfloat, 32>;
