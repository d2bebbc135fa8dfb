// The Metal launch of paged attention as data: a plan computed once, on any machine.
//
// On an Apple GPU the op hands the plan to MLX's JIT (mx::fast::metal_kernel), which
// writes a [[kernel]] signature around the plan's body, compiles header + kernel, and
// dispatches `grid` threads in threadgroups of `threadgroup`. Everything that decides
// whether that launch is right — the host checks, the padding of small metadata, the params
// packing, the template arguments, the grid — is computed by plan_paged_attention, which
// runs on Linux too: the tests give the plan to the Metal emulator
// (tools/metal_emulator/mlx_jit.py), which rebuilds the kernel MLX would compile and runs it.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/fast.h"

namespace tiny_llm {

namespace mx = mlx::core;

struct MetalLaunchPlan {
  // The arguments of mx::fast::metal_kernel(...)
  std::string name;
  std::vector<std::string> input_names;
  std::vector<std::string> output_names;
  std::string source;  // the kernel body
  std::string header;  // paged_attention_geometry.h, then metal/paged_attention.metal
  bool ensure_row_contiguous = true;
  bool atomic_outputs = false;
  // ... and of the kernel function it returns.
  std::vector<mx::array> inputs;
  std::vector<mx::Shape> output_shapes;
  std::vector<mx::Dtype> output_dtypes;
  std::tuple<int, int, int> grid;  // threads, as MLX dispatches them
  std::tuple<int, int, int> threadgroup;
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> template_args;
};

// Raises std::invalid_argument, naming the model's heads, head_dim, page size and dtype
// and the limit they break, unless the Metal kernels can serve this attention geometry.
void check_metal_geometry(int n_heads, int n_kv_heads, int head_dim, int page_size,
                          mx::Dtype dtype);

// The launch of paged attention for these inputs (shapes and dtypes checked by the op).
// `tiled`: Day 5's dispatch (vector rows + tiled multi-token queries); otherwise Day 4's
// vector schedule for every row. `tree_start` and `tree_mask`, together or neither: the
// rows of a token tree (paged_ops.h), which both kernels give the vector schedule. The
// plan's small arrays are built on `stream`.
MetalLaunchPlan plan_paged_attention(const mx::array& q, const mx::array& k_pages,
                                     const mx::array& v_pages, const mx::array& block_table,
                                     const mx::array& context_lens,
                                     const mx::array& query_start_loc, float scale, bool tiled,
                                     const std::optional<mx::array>& tree_start,
                                     const std::optional<mx::array>& tree_mask,
                                     mx::Stream stream);

// Runs a plan through mx::fast::metal_kernel on a GPU stream; returns its outputs.
std::vector<mx::array> launch_metal(const MetalLaunchPlan& plan, mx::Stream stream);

}  // namespace tiny_llm
