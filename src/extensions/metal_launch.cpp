// The Metal launch plan of paged attention (see metal_launch.h).
#include "metal_launch.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "metal/paged_attention_geometry.h"
#include "mlx/ops.h"
#include "paged_attention_metal_source.h"  // kGeometrySource, kKernelSource (CMake)

namespace tiny_llm {

using namespace paged_geometry;

namespace {

// MLX's JIT declares an input with fewer than this many elements in the `constant`
// address space (mlx/backend/common/metal_kernel.cpp); the kernels read all metadata as
// `device` memory, so smaller arrays are padded up to it.
constexpr int kMlxConstantArraySize = 8;
static_assert(kParamCount >= kMlxConstantArraySize, "params must be passed as device memory");
// Every geometry check_metal_geometry accepts launches threadgroups of this one size.
static_assert(kThreadsPerThreadgroup <= kMaxThreadsPerThreadgroup,
              "a threadgroup must fit in one Metal pipeline");
// A compiled pipeline may take fewer threads than that: its maxTotalThreadsPerThreadgroup
// falls as its kernel's registers grow, and only the GPU knows it, once it has built the
// pipeline, which mx::fast::metal_kernel keeps to itself (in C++ as in Python). MLX refuses
// a threadgroup larger than its pipeline takes before dispatching anything (at evaluation,
// in MLX's words), so a geometry past it fails at its first step, not silently. On a Mac,
// tests/test_metal_kernels.py reads that limit for the largest geometries accepted here.

std::string dtype_name(mx::Dtype dtype) {
  if (dtype == mx::float32) return "float32";
  if (dtype == mx::float16) return "float16";
  if (dtype == mx::bfloat16) return "bfloat16";
  return "a non-float dtype";
}

// The header MLX compiles ahead of the generated kernel: the geometry, then the kernels.
// #line keeps compiler messages (and the emulator's reports) in the files' own lines.
const std::string& metal_header() {
  static const std::string header = std::string("#line 1 \"paged_attention_geometry.h\"\n") +
                                    kGeometrySource + "#line 1 \"paged_attention.metal\"\n" +
                                    kKernelSource;
  return header;
}

// The kernel body: threadgroup memory sized by the geometry, then one entry function.
// MLX declares the inputs, outputs and every position attribute the body names.
// A kernel without a token tree passes null for its two inputs (every row causal).
std::string kernel_body(bool tiled, bool tree) {
  std::string body =
      "  threadgroup float tg_memory[paged_geometry::threadgroup_floats(GROUP, HEAD_DIM)];\n";
  body += tiled ? "  paged_attention_flash_entry" : "  paged_attention_vector_entry";
  body +=
      "<T, HEAD_DIM, GROUP>(q, k_pages, v_pages, block_table,\n"
      "      context_lens, query_start_loc, params,\n";
  body += tree ? "      tree_start, tree_mask, out, tg_memory,\n"
               : "      nullptr, nullptr, out, tg_memory,\n";
  body +=
      "      threadgroup_position_in_grid, simdgroup_index_in_threadgroup,\n"
      "      thread_index_in_simdgroup";
  body += tiled ? ", thread_index_in_threadgroup);\n" : ");\n";
  return body;
}

mx::array padded(const mx::array& a, mx::Stream stream) {
  auto flat = mx::reshape(a, {-1}, stream);
  const int n = flat.shape(0);
  if (n >= kMlxConstantArraySize) return flat;
  return mx::pad(flat, std::make_pair(0, kMlxConstantArraySize - n), mx::array(0, a.dtype()),
                 "constant", stream);
}

}  // namespace

// ANCHOR: metal_geometry_check
// Its largest geometries (the largest head_dim, the largest group) are cases the emulator
// runs in every dtype through both plans, and kernels `make metal-check` compiles.
void check_metal_geometry(int n_heads, int n_kv_heads, int head_dim, int page_size,
                          mx::Dtype dtype) {
  std::string problem;
  const int group = n_kv_heads > 0 ? n_heads / n_kv_heads : 0;
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) {
    problem = "attention runs in float32, float16 or bfloat16";
  } else if (n_kv_heads < 1 || n_heads < 1 || n_heads % n_kv_heads) {
    problem = "the query heads must be a positive multiple of the KV heads";
  } else if (group > kTilePairs) {
    problem = "a KV head serves at most " + std::to_string(kTilePairs) +
              " query heads (one tile row must hold a whole group)";
  } else if (head_dim % 8 || head_dim < 8 || head_dim > kMaxHeadDim) {
    problem = "head_dim must be a multiple of 8 in [8, " + std::to_string(kMaxHeadDim) +
              "] (simdgroup matrices are 8x8)";
  } else if (page_size < kKeyTile || page_size % kKeyTile) {
    problem = "page_size must be a multiple of " + std::to_string(kKeyTile) +
              " (a key tile must not straddle a page)";
  } else if (threadgroup_floats(group, head_dim) * 4 > kMaxThreadgroupBytes) {
    problem = "the kernels' state takes " + std::to_string(threadgroup_floats(group, head_dim) * 4) +
              " bytes of threadgroup memory, more than the " +
              std::to_string(kMaxThreadgroupBytes) + " an Apple GPU has";
  }
  if (!problem.empty()) {
    std::ostringstream msg;
    msg << "the Metal paged-attention kernels cannot serve " << n_heads << " query heads over "
        << n_kv_heads << " KV heads (group " << group << ") with head_dim " << head_dim
        << ", page_size " << page_size << " and " << dtype_name(dtype) << ": " << problem;
    throw std::invalid_argument(msg.str());
  }
}
// ANCHOR_END: metal_geometry_check

// ANCHOR: metal_plan
MetalLaunchPlan plan_paged_attention(const mx::array& q, const mx::array& k_pages,
                                     const mx::array& v_pages, const mx::array& block_table,
                                     const mx::array& context_lens,
                                     const mx::array& query_start_loc, float scale, bool tiled,
                                     const std::optional<mx::array>& tree_start,
                                     const std::optional<mx::array>& tree_mask,
                                     mx::Stream stream) {
  if (tree_start.has_value() != tree_mask.has_value())
    throw std::invalid_argument("paged_attention: tree_start and tree_mask go together");
  const int num_rows = q.shape(0), n_heads = q.shape(1), head_dim = q.shape(2);
  const int n_kv_heads = k_pages.shape(2), page_size = k_pages.shape(1);
  check_metal_geometry(n_heads, n_kv_heads, head_dim, page_size, q.dtype());
  const int group = n_heads / n_kv_heads;
  const int num_seqs = context_lens.shape(0);

  int32_t params[kParamCount] = {};
  params[kParamNumSeqs] = num_seqs;
  params[kParamMaxPages] = block_table.shape(1);
  params[kParamNHeads] = n_heads;
  params[kParamNKvHeads] = n_kv_heads;
  params[kParamPageSize] = page_size;
  std::memcpy(&params[kParamScaleBits], &scale, sizeof(scale));

  MetalLaunchPlan plan;
  const bool tree = tree_start.has_value();
  plan.name = tiled ? "tiny_llm_paged_attention_flash" : "tiny_llm_paged_attention_vector";
  if (tree) plan.name += "_tree";
  plan.input_names = {"q", "k_pages", "v_pages", "block_table", "context_lens",
                      "query_start_loc", "params"};
  if (tree) plan.input_names.insert(plan.input_names.end(), {"tree_start", "tree_mask"});
  plan.output_names = {"out"};
  plan.source = kernel_body(tiled, tree);
  plan.header = metal_header();
  plan.inputs = {q,
                 k_pages,
                 v_pages,
                 padded(block_table, stream),
                 padded(context_lens, stream),
                 padded(query_start_loc, stream),
                 mx::array(params, {kParamCount}, mx::int32)};
  if (tree)
    plan.inputs.insert(plan.inputs.end(),
                       {padded(*tree_start, stream), padded(*tree_mask, stream)});
  plan.output_shapes = {q.shape()};
  plan.output_dtypes = {q.dtype()};
  // Threadgroups: one per query row (vector schedule); with tiles, then
  // tiles_per_sequence per sequence (tiled schedule); each per KV head.
  const int64_t groups_x =
      num_rows + (tiled ? int64_t{num_seqs} * tiles_per_sequence(num_rows, group) : 0);
  if (groups_x * kThreadsPerThreadgroup > std::numeric_limits<int>::max())
    throw std::invalid_argument("paged_attention: " + std::to_string(num_rows) + " rows of " +
                                std::to_string(num_seqs) + " sequences exceed one Metal grid");
  plan.grid = {kThreadsPerThreadgroup * static_cast<int>(groups_x), n_kv_heads, 1};
  plan.threadgroup = {kThreadsPerThreadgroup, 1, 1};
  plan.template_args = {{"T", q.dtype()}, {"HEAD_DIM", head_dim}, {"GROUP", group}};
  return plan;
}
// ANCHOR_END: metal_plan

std::vector<mx::array> launch_metal(const MetalLaunchPlan& plan, mx::Stream stream) {
  // A course stub (a learner's unfinished task) must not reach the GPU: say which task.
  const std::string stub = "TINY_LLM_TASK_STUB(\"";
  if (const auto at = plan.header.find(stub); at != std::string::npos) {
    const auto from = at + stub.size();
    throw std::runtime_error(plan.header.substr(from, plan.header.find('"', from) - from));
  }
  // One JIT function per kernel (its source is fixed); MLX caches the compiled library.
  static std::mutex mutex;
  static std::map<std::string, mx::fast::CustomKernelFunction> kernels;
  mx::fast::CustomKernelFunction kernel;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = kernels.find(plan.name);
    if (it == kernels.end()) {
      it = kernels
               .emplace(plan.name,
                        mx::fast::metal_kernel(plan.name, plan.input_names, plan.output_names,
                                               plan.source, plan.header,
                                               plan.ensure_row_contiguous, plan.atomic_outputs))
               .first;
    }
    kernel = it->second;
  }
  return kernel(plan.inputs, plan.output_shapes, plan.output_dtypes, plan.grid,
                plan.threadgroup, plan.template_args, std::nullopt, false, stream);
}

}  // namespace tiny_llm
