// The CPU kernels' threads: a pool of workers that lives as long as the process.
//
// MLX runs a CPU primitive on its stream's single worker thread, so parallelism inside a
// kernel means threads of our own. A kernel runs once per layer per step, and spawning
// threads for each call cost more than small calls take, hence a persistent pool.
#pragma once

#include <functional>

namespace tiny_llm {

// Runs fn(0 .. n-1), spread over up to the configured number of threads (the calling
// thread included) when the job is large enough to pay for them: `flops_per_item` is the
// work of one item, and a job of less than about 2e5 flops in all stays on one thread.
// An exception thrown by fn is rethrown here after every thread has finished.
void parallel_for(int n, double flops_per_item, const std::function<void(int)>& fn);

// Threads the CPU kernels may use; 0 (the default) means every hardware thread.
void set_num_threads(int n);

// The threads a large job runs on: set_num_threads's number, else every hardware thread.
int pool_threads();

}  // namespace tiny_llm
