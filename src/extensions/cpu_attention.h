// CPU schedules of paged attention (the block-table interface of paged_ops.h).
//
// Vector schedule (Day 4): one work item per (query row, KV head) walks its sequence's
// block table page by page and keeps an online softmax (running max m, running sum l,
// running output acc) for the G query heads sharing the KV head, so each K/V row is read
// once for the whole group. Tiled schedule (Day 5): consecutive rows of a multi-token
// query go in tiles that share every page they read. Items run on the worker pool.
#pragma once

#include <cstdint>

namespace tiny_llm {

// Rows per query tile of the tiled schedule (query_tile 1: every row alone, Day 4).
constexpr int kCpuQueryTile = 16;

struct CpuAttentionShape {
  int num_seqs, max_pages, n_heads, n_kv_heads, head_dim, page_size;
  float scale;
  int query_tile;  // kCpuQueryTile (Day 5) or 1 (Day 4: the vector schedule for every row)
};

// Rows of a token tree (speculative decoding): row t sees the keys of its sequence before
// start[t], and of the keys start[t] + j only those whose bit j of mask[t] is set (its
// ancestors and itself). A row whose start[t] lies past its own key is causal.
struct CpuTreeRows {
  const int32_t* start;
  const uint64_t* mask;
};

// T is float, mlx::core::float16_t or mlx::core::bfloat16_t; scores and sums are float.
// tree: nullptr where every row is causal.
template <typename T>
void paged_attention_cpu(const T* q, const T* k_pages, const T* v_pages, const int32_t* tables,
                         const int32_t* context_lens, const int32_t* query_start_loc, T* out,
                         const CpuAttentionShape& shape, const CpuTreeRows* tree = nullptr);

}  // namespace tiny_llm
