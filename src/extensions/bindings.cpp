// Python bindings of the ops (module tiny_llm._native._ext), by family: the paged ops always;
// the model's CPU kernels (matmuls, layers, the fused decoder) except in the course's build
// of a learner's copy, which the engine uses for the paged ops only (tiny_llm/kernels/extension.py).
#include <cstring>
#include <memory>
#include <stdexcept>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cpu_attention.h"
#include "metal/paged_attention_geometry.h"
#include "metal_launch.h"
#include "paged_ops.h"
#include "profile.h"
#include "worker_pool.h"
#ifndef TINY_LLM_COURSE_KERNEL
#include "cpu_linear.h"
#include "decoder_ops.h"
#include "layer_ops.h"
#include "linear_ops.h"
#endif

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

#ifndef TINY_LLM_EXT_NAME
#define TINY_LLM_EXT_NAME _ext
#endif

namespace {

// The launch plan as a dict of plain values and MLX arrays (tests hand it to the emulator).
nb::dict plan_dict(const tiny_llm::MetalLaunchPlan& plan) {
  nb::dict d;
  d["name"] = plan.name;
  d["input_names"] = plan.input_names;
  d["output_names"] = plan.output_names;
  d["source"] = plan.source;
  d["header"] = plan.header;
  d["ensure_row_contiguous"] = plan.ensure_row_contiguous;
  d["atomic_outputs"] = plan.atomic_outputs;
  d["inputs"] = plan.inputs;
  nb::list shapes, dtypes;
  for (const auto& shape : plan.output_shapes) {
    nb::list dims;
    for (auto n : shape) dims.append(n);
    shapes.append(nb::tuple(dims));
  }
  for (const auto& dtype : plan.output_dtypes) dtypes.append(nb::cast(dtype));
  d["output_shapes"] = shapes;
  d["output_dtypes"] = dtypes;
  d["grid"] = plan.grid;
  d["threadgroup"] = plan.threadgroup;
  nb::list args;
  for (const auto& [name, value] : plan.template_args)
    args.append(nb::make_tuple(name, std::visit([](auto v) { return nb::cast(v); }, value)));
  d["template_args"] = args;
  return d;
}

void bind_paged_ops(nb::module_& m) {
  m.def("paged_attention", &tiny_llm::paged_attention, "q"_a, "k_pages"_a, "v_pages"_a,
        "block_table"_a, "context_lens"_a, "query_start_loc"_a, "scale"_a, nb::kw_only(),
        "tiled"_a = true, "gpu_rehearsal"_a = false, "tree_start"_a = nb::none(),
        "tree_mask"_a = nb::none(), "stream"_a = nb::none(),
        "Attention of flat queries over paged K/V through block tables (causal). tiled=False "
        "runs the vector schedule for every row (Day 4); True tiles multi-token queries (Day 5). "
        "gpu_rehearsal: on a CPU stream, make and check the Metal launch plan first. "
        "tree_start (int32 [T]) and tree_mask (uint64 [T]): rows of a token tree, which see "
        "the keys before tree_start and, after it, the keys whose bit is set.");
  m.def("paged_kv_write", &tiny_llm::paged_kv_write, "k_pages"_a, "v_pages"_a, "k_new"_a,
        "v_new"_a, "slot_mapping"_a, nb::kw_only(), "gpu_rehearsal"_a = false,
        "stream"_a = nb::none(),
        "Write new K/V rows into their slots; in place when the pools are donatable. "
        "gpu_rehearsal: on a CPU stream, write with MLX's scatter as a GPU stream does.");
  m.def(
      "donatable", [](const mx::array& a) { return a.is_donatable(); }, "a"_a,
      "Whether nothing but this array holds its buffer (MLX's is_donatable): no other array, "
      "view or graph node; an op may then write it in place.");
  m.def(
      "new_handle", [](const mx::array& a) { return a; }, "a"_a,
      "The same array (its node and buffer, no copy) under a new Python object. Put in "
      "place of the old object in a list, it leaves every other holder of the old object "
      "with a handle of its own, which is_donatable then counts.");
  m.def("pool_copies", &tiny_llm::pool_copies,
        "How many times paged_kv_write copied a pool that was not donatable.");
  m.def("set_num_threads", &tiny_llm::set_num_threads, "n"_a,
        "Threads the CPU kernels may use (0: all hardware threads).");
  m.def("profile", &tiny_llm::profile_enable, "on"_a,
        "Start (clearing the totals) or stop the CPU kernels' phase clocks (profile.h).");
  m.def(
      "profile_totals",
      [] {
        const tiny_llm::ProfileTotals totals = tiny_llm::profile_totals();
        nb::dict d;
        for (size_t i = 0; i < totals.ns.size(); ++i)
          d[tiny_llm::kPhaseNames[i]] = static_cast<double>(totals.ns[i]) * 1e-9;
        d["pool_jobs"] = totals.pool_jobs;
        d["solo_jobs"] = totals.solo_jobs;
        return d;
      },
      "Seconds of the calling thread in each phase since profile(True), exclusive of "
      "nested phases and of waiting for the pool (thread_wait); pool_jobs and solo_jobs: "
      "parallel_for calls run on several threads and on one.");
  m.def("check_metal_geometry", &tiny_llm::check_metal_geometry, "n_heads"_a, "n_kv_heads"_a,
        "head_dim"_a, "page_size"_a, "dtype"_a,
        "Raise ValueError unless the Metal kernels can serve this attention geometry.");
  m.def(
      "metal_launch_plan",
      [](const mx::array& q, const mx::array& k_pages, const mx::array& v_pages,
         const mx::array& block_table, const mx::array& context_lens,
         const mx::array& query_start_loc, float scale, bool tiled,
         const std::optional<mx::array>& tree_start, const std::optional<mx::array>& tree_mask,
         mx::StreamOrDevice s) {
        return plan_dict(tiny_llm::plan_paged_attention(q, k_pages, v_pages, block_table,
                                                        context_lens, query_start_loc, scale,
                                                        tiled, tree_start, tree_mask,
                                                        mx::to_stream(s)));
      },
      "q"_a, "k_pages"_a, "v_pages"_a, "block_table"_a, "context_lens"_a,
      "query_start_loc"_a, "scale"_a, nb::kw_only(), "tiled"_a = true,
      "tree_start"_a = nb::none(), "tree_mask"_a = nb::none(), "stream"_a = nb::none(),
      "The Metal launch (arguments of mx.fast.metal_kernel and of its kernel call) that a GPU "
      "stream would run, computed on any device.");
  m.attr("cpu_query_tile") = tiny_llm::kCpuQueryTile;
  m.def("metal_tile_rows", &paged_geometry::tile_rows, "group"_a,
        "Query rows per tile of the Metal tiled schedule for a GQA group of `group` heads.");
}

#ifndef TINY_LLM_COURSE_KERNEL
constexpr const char* kDecoderRun = "tiny_llm.DecoderRun";

void bind_model_kernels(nb::module_& m) {
  m.def(
      "linear",
      [](const mx::array& x, const mx::array& w, bool blas, mx::StreamOrDevice s) {
        return tiny_llm::linear(x, {w}, blas, s)[0];
      },
      "x"_a, "w"_a, nb::kw_only(), "blas"_a = false, "stream"_a = nb::none(),
      "x @ w.T in float32 on the CPU, each weight row read once for all rows of x; a row's "
      "result does not depend on the other rows. blas=True: MLX's BLAS (OpenBLAS) on "
      "blocks of weight rows spread over the worker pool (Linux).");
  m.def("linear_group", &tiny_llm::linear, "x"_a, "weights"_a, nb::kw_only(), "blas"_a = false,
        "stream"_a = nb::none(),
        "[x @ w.T for w in weights] as linear computes each, in one run of the worker pool "
        "(weights of one K: a layer's q, k and v, or its gate and up).");
  m.attr("has_blas_split") = tiny_llm::kHasBlasSplit;
  m.def("quantized_linear_group", &tiny_llm::quantized_linear, "x"_a, "weights"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, nb::kw_only(), "blas"_a = false,
        "int8"_a = false, "stream"_a = nb::none(),
        "[x @ dequantize(w, s, b).T for each (w, s, b)] in float32 on the CPU from MLX's "
        "affine layout; each output does not depend on the other rows of x. blas=True: "
        "blocks dequantized and multiplied by MLX's BLAS on the worker pool (Linux). "
        "int8=True: x rounded to int8 per 32 values, integer products (decode rows).");
  m.def(
      "quantized_kernel_serves",
      [](int group_size, int bits) { return tiny_llm::quantized_kernel_serves({group_size, bits}); },
      "group_size"_a, "bits"_a, "Whether quantized_linear_group serves this format.");
  m.def(
      "int8_kernel_serves",
      [](int group_size, int bits) { return tiny_llm::int8_kernel_serves({group_size, bits}); },
      "group_size"_a, "bits"_a, "Whether quantized_linear_group(int8=True) serves this format.");
  m.def("rope", &tiny_llm::rope, "x"_a, "positions"_a, "inv_freq"_a, "dims"_a, "traditional"_a,
        "scale"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Rotary embedding of x [T, H, D] with one position per row, in float32 on the CPU.");
  m.def("swiglu", &tiny_llm::swiglu, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up in float32 on the CPU, one op.");
  m.def("rms_norm", &tiny_llm::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "x * rsqrt(mean(x^2) + eps) * weight over the last axis, float32 on the CPU, one op.");
  m.def("argmax_rows", &tiny_llm::argmax_rows, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Each row's index of its largest value, as mx.argmax(x, axis=-1) (float32 [R, V] on "
        "a CPU stream; uint32 [R]): the greedy sampler's pick.");
  // The run is handed to Python as a capsule, not a bound class: the course builds a
  // learner's copy of this module beside it, and one C++ type bound by two modules is
  // registered only once.
  m.def(
      "decoder_run",
      [](const std::vector<tiny_llm::DecoderLayerArrays>& layers, int n_heads, int n_kv_heads,
         int head_dim, float eps, float post_eps, int rope_dims, bool rope_traditional,
         float rope_scale, float qk_eps, float scale) {
        using Run = std::shared_ptr<const tiny_llm::DecoderRun>;
        auto* run = new Run(tiny_llm::decoder_run(
            layers, {n_heads, n_kv_heads, head_dim, eps, post_eps, rope_dims, rope_traditional,
                     rope_scale, qk_eps, scale}));
        return nb::capsule(run, kDecoderRun, [](void* p) noexcept {
          delete static_cast<Run*>(p);
        });
      },
      "layers"_a, nb::kw_only(), "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "eps"_a,
      "post_eps"_a, "rope_dims"_a, "rope_traditional"_a, "rope_scale"_a, "qk_eps"_a = 0.0f,
      "scale"_a,
      "Consecutive decoder layers for decoder_layers, checked once (an opaque run): each "
      "layer (input_norm, qkv, qkv_biases, qk_norms, inv_freq, post_norm, o_proj, gate_up, "
      "down), each projection argument (arrays, group_size, bits): bits 0 for float32 "
      "weights [w...], else [w, scales, biases] of each.");
  m.def(
      "decoder_layers",
      [](nb::capsule run, const mx::array& x, const std::vector<mx::array>& k_pools,
         const std::vector<mx::array>& v_pools, const mx::array& positions,
         const mx::array& slot_mapping, const mx::array& block_table,
         const mx::array& context_lens, const mx::array& query_start_loc, bool tiled,
         bool int8, mx::StreamOrDevice s) {
        if (run.name() == nullptr || std::strcmp(run.name(), kDecoderRun) != 0)
          throw std::invalid_argument("decoder_layers needs a run made by decoder_run");
        return tiny_llm::decoder_layers(
            *static_cast<const std::shared_ptr<const tiny_llm::DecoderRun>*>(run.data()), x,
            k_pools, v_pools, positions, slot_mapping, block_table, context_lens,
            query_start_loc, tiled, int8, s);
      },
      "run"_a, "x"_a, "k_pools"_a, "v_pools"_a, "positions"_a, "slot_mapping"_a,
      "block_table"_a, "context_lens"_a, "query_start_loc"_a, nb::kw_only(), "tiled"_a,
      "int8"_a = false, "stream"_a = nb::none(),
      "The run's layers for decode rows x [T, dim] in one op (float32, CPU): per layer "
      "rms_norm, the q/k/v projections, their biases, the per-head norms and RoPE; its K/V "
      "rows written into its pools at slot_mapping, in place; paged attention, o_proj, the "
      "residual, rms_norm, the SwiGLU MLP and its residual; bit for bit those ops one by "
      "one. The pools must be held by nothing else (donatable).");
}
#endif

}  // namespace

#define TINY_LLM_STRINGIFY2(x) #x
#define TINY_LLM_STRINGIFY(x) TINY_LLM_STRINGIFY2(x)

NB_MODULE(TINY_LLM_EXT_NAME, m) {
  m.doc() = "tiny_llm's ops: paged attention (CPU C++ and Metal) and the model's CPU kernels";
  bind_paged_ops(m);
#ifndef TINY_LLM_COURSE_KERNEL
  bind_model_kernels(m);
#endif
  m.attr("module_name") = TINY_LLM_STRINGIFY(TINY_LLM_EXT_NAME);
}
