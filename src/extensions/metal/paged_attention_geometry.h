// Launch geometry of the Metal paged-attention kernels, defined once.
//
// Included by the host launcher (C++, metal_launch.cpp) and by the kernels (MSL,
// paged_attention.metal; the launcher hands MLX's JIT this file followed by the kernels).
// The grid and threadgroup the host computes, the tiles the kernels walk and the
// threadgroup memory both sides size all come from here, so they cannot disagree.
//
// Valid C++17 and MSL: enums and constexpr functions only (MSL would need program-scope
// variables in the `constant` address space, which C++ does not have).
#ifndef TINY_LLM_PAGED_ATTENTION_GEOMETRY
#define TINY_LLM_PAGED_ATTENTION_GEOMETRY

namespace paged_geometry {

enum : int {
  kSimdWidth = 32,
  kSimdgroups = 8,  // simdgroups per threadgroup
  kThreadsPerThreadgroup = kSimdWidth * kSimdgroups,
  // Tiled schedule: each simdgroup owns 8 (query row, head) pairs, one row of its 8x8
  // simdgroup matrices each, and keys are staged 8 at a time (a key tile never straddles
  // a page because page_size is a multiple of kKeyTile).
  kPairsPerSimdgroup = 8,
  kTilePairs = kPairsPerSimdgroup * kSimdgroups,
  kKeyTile = 8,
  kMaxThreadgroupBytes = 32768,  // threadgroup memory of every Apple GPU family
  kMaxThreadsPerThreadgroup = 1024,  // the most a Metal pipeline dispatches in one group
  kMaxHeadDim = 256,
};

// Query rows per tile of the tiled schedule: a row brings its `group` heads as pairs, so a
// group that does not divide kTilePairs leaves kTilePairs % group pairs idle.
constexpr int tile_rows(int group) { return kTilePairs / group; }

// Tiled threadgroups per sequence: enough tiles for any sequence of a step with
// `num_rows` query rows in all (the host does not read query_start_loc).
constexpr int tiles_per_sequence(int num_rows, int group) {
  return (num_rows + tile_rows(group) - 1) / tile_rows(group);
}

// The params buffer: int32 values at these indices (the scale as its float's bits),
// padded to kParamCount elements (see metal_launch.cpp for why 8).
enum : int {
  kParamNumSeqs = 0,
  kParamMaxPages = 1,
  kParamNHeads = 2,
  kParamNKvHeads = 3,
  kParamPageSize = 4,
  kParamScaleBits = 5,
  kParamCount = 8,
};

// Threadgroup memory, in floats: one array carved into these regions, in this order.
//   state        the vector schedule's running max per (simdgroup, head), or the tiled
//                schedule's row sums per pair (the two never share a threadgroup);
//   simd sums    the vector schedule's running sum per (simdgroup, head);
//   accumulator  the vector schedule's merged output, group x head_dim;
//   K, V tiles   kKeyTile keys x head_dim each (tiled schedule);
//   scratch      one 8x8 matrix per simdgroup (tiled schedule).
constexpr int state_floats(int group) {
  return kTilePairs > kSimdgroups * group ? kTilePairs : kSimdgroups * group;
}
constexpr int offset_simd_sums(int group) { return state_floats(group); }
constexpr int offset_accumulator(int group) {
  return offset_simd_sums(group) + kSimdgroups * group;
}
constexpr int offset_k_tile(int group, int head_dim) {
  return offset_accumulator(group) + group * head_dim;
}
constexpr int offset_v_tile(int group, int head_dim) {
  return offset_k_tile(group, head_dim) + kKeyTile * head_dim;
}
constexpr int offset_scratch(int group, int head_dim) {
  return offset_v_tile(group, head_dim) + kKeyTile * head_dim;
}
constexpr int threadgroup_floats(int group, int head_dim) {
  return offset_scratch(group, head_dim) + kSimdgroups * kPairsPerSimdgroup * kKeyTile;
}

}  // namespace paged_geometry

#endif  // TINY_LLM_PAGED_ATTENTION_GEOMETRY
