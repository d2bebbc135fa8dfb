// The paged ops of tiny_llm: one block-table interface, CPU kernels in C++
// (cpu_attention.cpp) and Metal kernels JIT-compiled by MLX on Apple GPUs (metal_launch.cpp).
//
//   paged_attention(q [T, Hq, D], k_pages, v_pages [P, page_size, Hkv, D],
//                   block_table int32 [B, max_pages], context_lens int32 [B],
//                   query_start_loc int32 [B + 1], scale, tiled) -> [T, Hq, D]
//       tiled: rows of multi-token queries take the tiled schedule (Day 5); otherwise
//       every row takes the vector schedule (Day 4). tree_start int32 [T] and tree_mask
//       uint64 [T], optional and together: rows of a token tree (speculative decoding), which
//       see the keys before tree_start[t] and, of the keys tree_start[t] + j, those whose
//       bit j is set (CpuTreeRows); both schedules serve them, on a CPU and in Metal.
//   paged_kv_write(k_pages, v_pages, k_new, v_new [T, Hkv, D], slot_mapping int32 [T])
//       -> (k_pages, v_pages), written in place when the pool is donatable.
//   Both take gpu_rehearsal (tiny_llm/kernels/device.py): on a CPU stream, decide as a GPU stream
//   does (the Metal launcher's checks and plan; MLX's scatter as the write), then compute
//   on the CPU.
//
// Metadata is validated by the Python wrapper (tiny_llm/day4_paged_attention.py) before
// any kernel runs; these ops check only shapes and dtypes.
#pragma once

#include <optional>
#include <tuple>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace tiny_llm {

namespace mx = mlx::core;

mx::array paged_attention(
    const mx::array& q,
    const mx::array& k_pages,
    const mx::array& v_pages,
    const mx::array& block_table,
    const mx::array& context_lens,
    const mx::array& query_start_loc,
    float scale,
    bool tiled = true,
    bool gpu_rehearsal = false,
    const std::optional<mx::array>& tree_start = std::nullopt,
    const std::optional<mx::array>& tree_mask = std::nullopt,
    mx::StreamOrDevice s = {});

std::tuple<mx::array, mx::array> paged_kv_write(
    const mx::array& k_pages,
    const mx::array& v_pages,
    const mx::array& k_new,
    const mx::array& v_new,
    const mx::array& slot_mapping,
    bool gpu_rehearsal = false,
    mx::StreamOrDevice s = {});

// How many times paged_kv_write had to copy a pool because it was not donatable
// (another reference was alive). The engine keeps this at 0; tests and benches read it.
int pool_copies();

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, float scale, bool tiled)
      : mx::Primitive(stream), scale_(scale), tiled_(tiled) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  bool tiled_;
};

// Inputs: one pool, its new rows, the slot mapping. Output: the pool after the write.
class PagedKVWrite : public mx::Primitive {
 public:
  explicit PagedKVWrite(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "PagedKVWrite"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace tiny_llm
