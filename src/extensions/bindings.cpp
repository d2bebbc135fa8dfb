// Python bindings of the paged ops (module tiny_llm._native._ext).
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>

#include "paged_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "tiny_llm paged attention kernels (CPU C++ and Metal)";
  m.def("paged_attention", &tiny_llm::paged_attention, "q"_a, "k_pages"_a, "v_pages"_a,
        "block_table"_a, "context_lens"_a, "query_start_loc"_a, "scale"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "Attention of flat queries over paged K/V through block tables (causal).");
  m.def("paged_kv_write", &tiny_llm::paged_kv_write, "k_pages"_a, "v_pages"_a, "k_new"_a,
        "v_new"_a, "slot_mapping"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Write new K/V rows into their slots; in place when the pools are donatable.");
  m.def("pool_copies", &tiny_llm::pool_copies,
        "How many times paged_kv_write copied a pool that was not donatable.");
  m.def("set_num_threads", &tiny_llm::set_num_threads, "n"_a,
        "Threads the CPU kernels may use (0: all hardware threads).");
}
