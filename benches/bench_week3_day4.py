"""Week 3, Day 4: attention that reads the pages in place, against gathering them first.

Three measurements, each running the configurations it compares side by side in one run,
interleaved (the order rotates from call to call), reporting medians and ratios:

1. **Decode attention, one layer** (SmolLM2-135M's head config: 9 query heads, 3 KV heads,
   head_dim 64; float32; page_size 16). Every sequence of the batch has the same context
   length and its pages are a random permutation of the pool (shuffled, as after churn).
   One query token per sequence. The same output computed these ways:

   - ``day3 gather``: what Day 3's ``GatherAttention.attend`` does after its write: for
     each sequence, ``PagePool.gather`` copies its K/V rows into a dense array, then
     ``causal_attention``; the outputs are concatenated;
   - ``MLX reference walk``: ``paged_attention_reference`` (MLX ops, one page column per
     iteration, online softmax);
   - ``vector kernel``: ``paged_attention`` (the extension's vector schedule, ``tiled=False``,
     on its persistent CPU worker pool), once with the pool limited to **1 thread** and once
     with **every core** (``extension().set_num_threads(n)``, the process-wide setting the
     op reads when it runs; the pool uses several threads only when the work is large
     enough, about 2e5 flops per thread);
   - ``mx.fast``: ``mx.fast.scaled_dot_product_attention`` on K/V gathered *beforehand*
     into dense ``[B, Hkv, L, D]`` arrays (GQA handled by MLX): the floor with no gather.
     It runs on MLX's single CPU stream thread (its matmuls through OpenBLAS, one thread by
     default), so the **equal-thread comparison is kernel 1 thread / mx.fast**; the
     kernel on every core is reported beside it, labelled as such.

   Reported: ms per call, kernel / mx.fast at 1 thread and at every core, kernel / day3,
   and the kernel's effective bandwidth, bytes of K and V it must read
   (``2 * B * L * Hkv * D * 4``) / its time.
2. **KV write vs pool size**: ``paged_kv_write`` (the extension, the caller dropping its
   reference to the old pool before evaluation, as the kernel backends do) vs Day 3's
   ``PagePool.write`` (MLX indexed assignment) for 8 and 64 new rows into pools of 1k to
   512k slots (one layer, K and V). A control keeps the old pool referenced (that write
   must copy). Also reported: ``extension().pool_copies()`` per call, and whether the
   time is flat in the pool size (O(new rows)) or grows with it (O(pool)).
3. **Serving**: SmolLM2-135M (float32) on one workload — 8 requests at t=0 with prompts
   of 100-300 random token ids, 32-48 output tokens each (greedy, ``ignore_eos``),
   ``max_num_seqs=8`` — under these engine configurations: ``kv_cache="dense"``;
   ``attention="gather"`` (Day 3); ``attention="page_walk"`` (Day 4's MLX page walk);
   ``attention="vector"`` (Day 4's kernel, vector schedule for every row) with the
   extension on every core and on 1 thread. Every engine runs with ``cpu_kernels=False``:
   the model's matmuls, norms and RoPE by MLX's ops (OpenBLAS on one thread) in all of
   them, so they differ in attention alone and the kernel's thread count is attention's
   only (with the CPU kernels on, one thread would also slow the extension's matmuls,
   which share its pool). The engines are built side by side and take
   turns, one ``step()`` each (rotating who goes first), so a noisy neighbour slows them
   alike; each one's time is the sum of its own step times. Once per turn the model
   forward for 8 decode tokens with attention replaced by the identity is timed too: the
   part of a decode step that no attention path changes. Reported: output tok/s, decode
   tok/s (steps that compute no prompt token), the KV memory (the engine's
   ``kv_cache_bytes``; peak live K/V bytes of the running requests), the bytes the
   attention path copies per decode step (gather: context rows x layers x K,V; kernel: 0
   plus whole-pool copies counted by ``pool_copies()``), and whether all configurations
   produce the same tokens.

Rounds: each point of (1) and (2) times every method ``calls`` times per round, the order
rotating from call to call, for ``--rounds`` rounds (default 3); the median over rounds of
the per-round medians is reported (the JSON keeps every round's). (3) runs once per round.

BLAS: MLX's float32 GEMM goes through OpenBLAS (``tiny_llm`` interposes it) on one thread
(``tiny_llm``'s default unless ``OPENBLAS_NUM_THREADS`` is set; the count is recorded).

On a Mac's GPU every configuration runs on the GPU: the vector kernel is the Metal kernel
(one run, labelled "GPU", instead of the CPU's thread counts), mx.fast and the MLX ops run
there too, and the tables' columns say so (``common.kernel_thread_counts``).

    python benches/bench_week3_day4.py          # about 5 minutes on 2 cores (3 rounds)
    python benches/bench_week3_day4.py --quick  # tiny random model in part 3, writes *_quick.*
"""

from __future__ import annotations

import faulthandler
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from tiny_llm import LLMEngine, causal_attention, extension, kv_bytes_per_token, openblas_threads
from tiny_llm.day3_paged_kv import PagePool
from tiny_llm.day4_paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_kv_write,
)

import mlx.core as mx
import numpy as np
from common import (
    Table,
    bench_device,
    bench_parser,
    gpu_words,
    greedy,
    kernel_thread_counts,
    load_model,
    mlx_cpu_threads,
    save_results,
    spread,
    threads_label,
    with_threads,
)

# SmolLM2-135M's attention geometry.
N_HEADS, N_KV_HEADS, HEAD_DIM = 9, 3, 64
PAGE_SIZE = 16
SCALE = HEAD_DIM**-0.5
DTYPE = mx.float32

# On the CPU the worker pool limited to 1 thread, and every core; on a GPU one run (None).
KERNEL_THREADS = kernel_thread_counts()
ON_CPU = bench_device() == "cpu"


def kernel_name(threads: int | None) -> str:
    return f"vector kernel, {threads_label(threads)}"


ONE = kernel_name(KERNEL_THREADS[0])  # the equal-thread comparison with MLX's one thread
ALL = kernel_name(KERNEL_THREADS[-1])  # every core (the same run where there is one)
# What ALL is called in ratio columns, and mx.fast's own label.
ALL_SHORT = f"kernel {threads_label(KERNEL_THREADS[-1])}" if ON_CPU else "kernel"
FAST = f"mx.fast, {threads_label(mlx_cpu_threads())}" if ON_CPU else "mx.fast"
# The equal-thread comparison: the kernel on one thread against MLX on one thread.
EQUAL_THREADS = ON_CPU and KERNEL_THREADS[0] == 1 and mlx_cpu_threads() == 1
ATTN_METHODS = ("day3 gather", "MLX reference walk", *map(kernel_name, KERNEL_THREADS),
                "mx.fast")
# The reference walk is skipped where batch * context exceeds this (none in the full grid:
# its largest point, 32 x 8,192, takes a few hundred ms).
REF_MAX_KEYS = 32 * 8192

WRITE_METHODS = ("extension", "day3 PagePool.write", "extension, old pool kept")
CONTROL_MAX_SLOTS = 131072  # the kept-pool control must copy: skip it on the largest pools

SERVE_CONFIGS: dict[str, dict[str, Any]] = {
    "dense": dict(kv_cache="dense"),
    "paged + gather (Day 3)": dict(kv_cache="paged", attention="gather"),
    "paged + MLX reference walk (Day 4)": dict(kv_cache="paged", attention="page_walk"),
    **{f"paged + {kernel_name(n)} (Day 4)": dict(kv_cache="paged", attention="vector",
                                                 kernel_threads=n)
       for n in sorted(KERNEL_THREADS, key=lambda n: -(n or 0))},
}
MAX_NUM_SEQS = 8


def interleaved(fns: dict[str, Callable[[], Any]], warmup: int, rounds: int, calls: int,
                after: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Time every function ``calls`` times per round for ``rounds`` rounds, the order
    rotating from call to call; ``after(name)`` runs untimed after each call. Returns per
    function the ``spread`` of its per-round medians and every time."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            mx.eval(fns[name]())
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    k = 0
    for _ in range(rounds):
        for n in names:
            times[n].append([])
        for _ in range(calls):
            for name in names[k % len(names):] + names[: k % len(names)]:
                start = time.perf_counter()
                mx.eval(fns[name]())
                times[name][-1].append(time.perf_counter() - start)
                mx.synchronize()  # untimed: let the stream finish what the call left behind
                if after:
                    after(name)
            k += 1
    return {n: {**spread([statistics.median(r) for r in t]), "times": t,
                "calls": sum(map(len, t))} for n, t in times.items()}


# --------------------------------------------------------------------------------------
# 1. Decode attention vs context length and batch
# --------------------------------------------------------------------------------------

def attention_point(batch: int, context: int, warmup: int, rounds: int, calls: int,
                    rng: np.random.Generator) -> dict[str, Any]:
    pages_per_seq = context // PAGE_SIZE
    num_pages = batch * pages_per_seq
    table = rng.permutation(num_pages).astype(np.int32).reshape(batch, pages_per_seq)
    pool = PagePool(1, num_pages, PAGE_SIZE, N_KV_HEADS, HEAD_DIM, DTYPE)
    shape = (num_pages, PAGE_SIZE, N_KV_HEADS, HEAD_DIM)
    pool.k[0] = mx.random.normal(shape, DTYPE)
    pool.v[0] = mx.random.normal(shape, DTYPE)
    q = mx.random.normal((batch, N_HEADS, HEAD_DIM), DTYPE)
    block_table = mx.array(table)
    context_lens = mx.full((batch,), context, dtype=mx.int32)
    query_start_loc = mx.arange(batch + 1, dtype=mx.int32)
    offsets = np.arange(PAGE_SIZE, dtype=np.int32)
    slots = [mx.array((table[b][:, None] * PAGE_SIZE + offsets).reshape(-1)) for b in range(batch)]
    # The floor's inputs: every sequence's K/V gathered once, outside the timed region.
    k_dense = mx.contiguous(mx.stack([pool.gather(0, s)[0] for s in slots]).transpose(0, 2, 1, 3))
    v_dense = mx.contiguous(mx.stack([pool.gather(0, s)[1] for s in slots]).transpose(0, 2, 1, 3))
    q_dense = q[:, :, None, :]
    mx.eval(pool.k, pool.v, q, k_dense, v_dense, slots)

    def day3():
        outs = []
        for b, s in enumerate(slots):
            keys, values = pool.gather(0, s)
            outs.append(causal_attention(q[b : b + 1], keys, values, SCALE, context - 1))
        return mx.concatenate(outs)

    def kernel():
        return paged_attention(q, pool.k[0], pool.v[0], block_table, context_lens,
                               query_start_loc, SCALE, validate=False)

    fns = {
        "day3 gather": day3,
        "MLX reference walk": lambda: paged_attention_reference(
            q, pool.k[0], pool.v[0], block_table, context_lens, query_start_loc, SCALE),
        **{kernel_name(n): with_threads(kernel, n) for n in KERNEL_THREADS},
        "mx.fast": lambda: mx.fast.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, scale=SCALE)[:, :, 0, :],
    }
    skipped = batch * context > REF_MAX_KEYS
    if skipped:
        del fns["MLX reference walk"]
    # Every path must agree with the kernel before it is timed.
    want = fns[ONE]()
    max_err = {n: float(mx.abs(f() - want).max()) for n, f in fns.items() if n != ONE}
    timings = interleaved(fns, warmup, rounds, calls)
    kv_bytes = 2 * batch * context * N_KV_HEADS * HEAD_DIM * DTYPE.size
    ms = {n: (timings[n]["median"] * 1e3 if n in timings else None) for n in ATTN_METHODS}
    return {
        "batch": batch,
        "context": context,
        "ms": ms,
        "rounds_s": {n: t for n, t in timings.items()},
        "kernel_1t_over_fast": ms[ONE] / ms["mx.fast"],
        "kernel_all_over_fast": ms[ALL] / ms["mx.fast"],
        "kernel_over_day3": ms[ALL] / ms["day3 gather"],
        "kernel_over_reference": None if skipped else ms[ALL] / ms["MLX reference walk"],
        "kv_bytes": kv_bytes,
        "kernel_1t_gb_s": kv_bytes / timings[ONE]["median"] / 1e9,
        "kernel_all_gb_s": kv_bytes / timings[ALL]["median"] / 1e9,
        "fast_gb_s": kv_bytes / timings["mx.fast"]["median"] / 1e9,
        "reference_skipped": skipped,
        "max_abs_err_vs_kernel": max_err,
    }


def attention_sweep(batches, contexts, warmup, rounds, calls) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    mx.random.seed(0)
    points = []
    for batch in batches:
        for context in contexts:
            p = attention_point(batch, context, warmup, rounds, calls, rng)
            points.append(p)
            ms = p["ms"]
            print(f"attention B={batch:>2} L={context:>5}: " + ", ".join(
                f"{n} {ms[n]:.3f} ms" if ms[n] is not None else f"{n} skipped"
                for n in ATTN_METHODS) + f"; kernel 1T/mx.fast {p['kernel_1t_over_fast']:.2f}",
                flush=True)
    return points


# --------------------------------------------------------------------------------------
# 2. KV write vs pool size
# --------------------------------------------------------------------------------------

def write_point(pool_slots: int, rows: int, warmup: int, rounds: int, calls: int,
                rng: np.random.Generator) -> dict[str, Any]:
    num_pages = pool_slots // PAGE_SIZE
    shape = (num_pages, PAGE_SIZE, N_KV_HEADS, HEAD_DIM)
    ext_pool = {"k": mx.zeros(shape, DTYPE), "v": mx.zeros(shape, DTYPE)}
    day3_pool = PagePool(1, num_pages, PAGE_SIZE, N_KV_HEADS, HEAD_DIM, DTYPE)
    k_new = mx.random.normal((rows, N_KV_HEADS, HEAD_DIM), DTYPE)
    v_new = mx.random.normal((rows, N_KV_HEADS, HEAD_DIM), DTYPE)
    slots = mx.array(rng.choice(pool_slots, rows, replace=False).astype(np.int32))
    mx.eval(ext_pool["k"], ext_pool["v"], k_new, v_new, slots)

    def extension_write():
        # The engine's pattern: the new pools replace the old ones before evaluation, so
        # nothing but the write itself references the old buffers.
        ext_pool["k"], ext_pool["v"] = paged_kv_write(
            ext_pool["k"], ext_pool["v"], k_new, v_new, slots, validate=False)
        return [ext_pool["k"], ext_pool["v"]]

    def day3_write():
        day3_pool.write(0, slots, k_new, v_new)
        return [day3_pool.k[0], day3_pool.v[0]]

    def kept_write():
        # ext_pool still holds the old pools: this write must not change them (a copy).
        return list(paged_kv_write(ext_pool["k"], ext_pool["v"], k_new, v_new, slots,
                                   validate=False))

    fns = {"extension": extension_write, "day3 PagePool.write": day3_write}
    copies = {n: 0 for n in WRITE_METHODS}
    last = [0]

    def count(name: str) -> None:
        now = extension().pool_copies()
        copies[name] += now - last[0]
        last[0] = now

    for _ in range(warmup):
        for fn in fns.values():
            mx.eval(fn())
    last[0] = extension().pool_copies()  # copies are counted on the timed calls only
    timings = interleaved(fns, 0, rounds, calls, after=count)
    if pool_slots <= CONTROL_MAX_SLOTS:
        # Timed on its own, after the others: freeing its whole-pool copies finishes on
        # MLX's stream thread after eval returns and would bill the next call timed.
        control = {"extension, old pool kept": kept_write}
        last[0] = extension().pool_copies()
        timings |= interleaved(control, 0, rounds, max(1, calls // 2), after=count)
    # Both pools must hold the rows at their slots.
    for k, v in ((ext_pool["k"], ext_pool["v"]), (day3_pool.k[0], day3_pool.v[0])):
        flat = (N_KV_HEADS, HEAD_DIM)
        ok = mx.array_equal(k.reshape(-1, *flat)[slots], k_new) and mx.array_equal(
            v.reshape(-1, *flat)[slots], v_new)
        if not ok.item():
            raise RuntimeError(f"a write lost rows (pool {pool_slots} slots, {rows} rows)")
    us = {n: (timings[n]["median"] * 1e6 if n in timings else None) for n in WRITE_METHODS}
    return {
        "pool_slots": pool_slots,
        "rows": rows,
        "pool_bytes": 2 * num_pages * PAGE_SIZE * N_KV_HEADS * HEAD_DIM * DTYPE.size,
        "us": us,
        "rounds_s": timings,
        "pool_copies_per_call": {n: copies[n] / timings[n]["calls"] for n in timings},
        "extension_over_day3": us["extension"] / us["day3 PagePool.write"],
    }


def write_sweep(pool_sizes, row_counts, warmup, rounds, calls) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    points = []
    for pool_slots in pool_sizes:
        for rows in row_counts:
            p = write_point(pool_slots, rows, warmup, rounds, calls, rng)
            points.append(p)
            print(f"write {pool_slots:>6} slots, {rows:>2} rows: " + ", ".join(
                f"{n} {p['us'][n]:.0f} us" for n in WRITE_METHODS if p["us"][n] is not None)
                + f"; extension pool copies/call {p['pool_copies_per_call']['extension']:.1f}",
                flush=True)
    return points


def write_flatness(points, pool_sizes, row_counts) -> list[list[Any]]:
    """Per method and row count: time at the largest pool / time at the smallest."""
    rows = []
    lo, hi = min(pool_sizes), max(pool_sizes)
    for method in WRITE_METHODS:
        for n in row_counts:
            by_size = {p["pool_slots"]: p for p in points if p["rows"] == n}
            sizes = [s for s in (lo, hi) if by_size[s]["us"][method] is not None]
            if len(sizes) < 2:
                top = max(s for s in pool_sizes if by_size[s]["us"][method] is not None)
                sizes = [lo, top]
            a, b = (by_size[s]["us"][method] for s in sizes)
            growth = b / a
            copies = by_size[sizes[1]]["pool_copies_per_call"][method]
            verdict = "flat: O(new rows)" if growth < 3 else "grows: O(pool)"
            rows.append([method, n, sizes[0], sizes[1], a, b, growth, copies, verdict])
    return rows


# --------------------------------------------------------------------------------------
# 3. Serving progression
# --------------------------------------------------------------------------------------

def serve_workload(num_requests: int, prompt_range, output_range, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(*prompt_range))]
               for _ in range(num_requests)]
    outputs = [rng.randint(*output_range) for _ in range(num_requests)]
    return prompts, outputs


class ServeRun:
    """One engine serving the workload, advanced one ``step()`` at a time so that several
    configurations can take turns step by step (the noise of a shared machine then falls
    on all of them alike). Times are the sums of each engine's own step times."""

    def __init__(self, model, tokenizer, options: dict[str, Any], prompts, max_tokens,
                 max_model_len: int):
        options = dict(options)
        self.kernel_threads = options.pop("kernel_threads", KERNEL_THREADS[-1])
        self.engine = engine = LLMEngine(
            model, tokenizer, max_num_seqs=MAX_NUM_SEQS, max_model_len=max_model_len,
            enable_prefix_caching=False, cpu_kernels=False, **options)
        self.gathers = engine.config.attention == "gather"
        self.token_bytes = kv_bytes_per_token(model.config, model.dtype)  # K+V, all layers
        pool = getattr(engine.kv, "pool", None)
        self.layer_pool_bytes = pool.k[0].nbytes if pool is not None else 0
        self.ids = [engine.add_request({"prompt_token_ids": p}, greedy(n))
                    for p, n in zip(prompts, max_tokens, strict=True)]
        self.tokens: dict[str, list[int]] = {i: [] for i in self.ids}
        self.steps: list[dict[str, Any]] = []

    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        engine = self.engine
        prompt_before = engine.stats()["num_prompt_tokens_computed"]
        copies_before = extension().pool_copies()
        extension().set_num_threads(self.kernel_threads or 0)  # None (a GPU): the default
        t0 = time.perf_counter()
        try:
            outs = engine.step()
            dt = time.perf_counter() - t0
        finally:
            extension().set_num_threads(0)
        new = 0
        for out in outs:
            self.tokens[out.request_id] += out.new_token_ids
            new += len(out.new_token_ids)
        stats = engine.stats()
        live_tokens = sum(r.num_computed_tokens for r in engine.scheduler.running)
        # Day 3's gather copies every scheduled sequence's context rows, in every layer.
        gathered = sum(engine.attention.step.context_lens) if self.gathers else 0
        self.steps.append({
            "dt": dt,
            "tokens": new,
            "decode_only": stats["num_prompt_tokens_computed"] == prompt_before,
            "live_kv_bytes": live_tokens * self.token_bytes,
            "kv_cache_bytes": stats["kv_cache_bytes"],
            "gather_bytes": gathered * self.token_bytes,
            "pool_copy_bytes": (extension().pool_copies() - copies_before)
            * self.layer_pool_bytes,
        })

    def result(self) -> dict[str, Any]:
        steps = self.steps
        decode = [s for s in steps if s["decode_only"]]
        busy = sum(s["dt"] for s in steps)
        produced = sum(s["tokens"] for s in steps)
        return {
            "tokens": [self.tokens[i] for i in self.ids],
            "output_tokens": produced,
            "busy_s": busy,
            "tok_per_s": produced / busy,
            "decode_steps": len(decode),
            "decode_tok_per_s": sum(s["tokens"] for s in decode) / sum(s["dt"] for s in decode),
            "decode_ms_per_step": 1e3 * statistics.median(s["dt"] for s in decode),
            "steps": len(steps),
            "kv_cache_bytes": max(s["kv_cache_bytes"] for s in steps),
            "peak_live_kv_bytes": max(s["live_kv_bytes"] for s in steps),
            "gather_bytes_per_decode_step": statistics.mean(s["gather_bytes"] for s in decode),
            "pool_copy_bytes_per_decode_step": statistics.mean(
                s["pool_copy_bytes"] for s in decode),
            "pool_copies": sum(s["pool_copy_bytes"] for s in steps)
            // max(1, self.layer_pool_bytes),
            "num_pages": self.engine.stats().get("num_pages"),
        }


def run_interleaved(runs: dict[str, ServeRun],
                    extra: Callable[[], Any] | None = None) -> list[float]:
    """Step every engine in turn (rotating who goes first) until all are done; ``extra``
    (if given) is timed once per turn too, under the same conditions."""
    names = list(runs)
    turn = 0
    extra_times = []
    while not all(r.done() for r in runs.values()):
        k = turn % len(names)
        for name in names[k:] + names[:k]:
            if not runs[name].done():
                runs[name].step()
        if extra is not None:
            t0 = time.perf_counter()
            mx.eval(extra())
            extra_times.append(time.perf_counter() - t0)
        turn += 1
    return extra_times


def serving_round(model, tokenizer, prompts, max_tokens, max_model_len, forward):
    runs = {n: ServeRun(model, tokenizer, o, prompts, max_tokens, max_model_len)
            for n, o in SERVE_CONFIGS.items()}
    forward_times = run_interleaved(runs, forward)
    results = {n: r.result() for n, r in runs.items()}
    for n, m in results.items():
        print(f"serve {n}: {m['output_tokens']} tokens in {m['busy_s']:.1f} s of steps, "
              f"{m['tok_per_s']:.1f} tok/s, decode {m['decode_tok_per_s']:.1f} tok/s "
              f"({m['decode_ms_per_step']:.0f} ms/step), pool copies {m['pool_copies']}",
              flush=True)
    return results, 1e3 * statistics.median(forward_times)


def forward_without_attention(model) -> Callable[[], mx.array]:
    """One decode step's model forward for MAX_NUM_SEQS tokens with attention replaced by
    the identity: what a decode step costs besides attention and the KV write."""

    class NoAttention:
        def attend(self, layer, q, k, v, scale):
            return q

    n = MAX_NUM_SEQS
    tokens = mx.full((n,), 100, dtype=mx.int32)
    positions = mx.full((n,), 300, dtype=mx.int32)
    rows = mx.arange(n, dtype=mx.int32)
    return lambda: model(tokens, positions, NoAttention(), rows)


# --------------------------------------------------------------------------------------
# Tables, figure, main
# --------------------------------------------------------------------------------------

ONE_SHORT = f"kernel {threads_label(KERNEL_THREADS[0])}" if ON_CPU else "kernel"


def attention_columns() -> list[tuple[str, str, Callable[[dict[str, Any]], Any]]]:
    """Table 1's columns (header, format, value of a point), labelled by what ran: the
    kernel at each thread count on the CPU, once on a GPU."""
    columns = [("batch", "", lambda p: p["batch"]), ("context", "", lambda p: p["context"]),
               ("day3 gather (ms)", ".3f", lambda p: p["ms"]["day3 gather"]),
               ("MLX reference walk (ms)", ".3f", lambda p: p["ms"]["MLX reference walk"])]
    columns += [(f"{kernel_name(n)} (ms)", ".3f", lambda p, n=n: p["ms"][kernel_name(n)])
                for n in KERNEL_THREADS]
    columns.append((f"{FAST} (ms)", ".3f", lambda p: p["ms"]["mx.fast"]))
    if ONE != ALL and EQUAL_THREADS:
        columns.append((f"{ONE_SHORT} / mx.fast, both 1 thread", ".2f",
                        lambda p: p["kernel_1t_over_fast"]))
    columns += [
        (f"{ALL_SHORT} / {FAST}", ".2f", lambda p: p["kernel_all_over_fast"]),
        (f"{ALL_SHORT} / day3", ".2f", lambda p: p["kernel_over_day3"]),
        (f"{ALL_SHORT} / reference", ".2f", lambda p: p["kernel_over_reference"]),
        ("K+V (MiB)", ".1f", lambda p: p["kv_bytes"] / 2**20),
    ]
    if ONE != ALL:
        columns.append((f"{ONE_SHORT} GB/s", ".2f", lambda p: p["kernel_1t_gb_s"]))
    columns += [(f"{ALL_SHORT} GB/s", ".2f", lambda p: p["kernel_all_gb_s"]),
                ("mx.fast GB/s", ".2f", lambda p: p["fast_gb_s"])]
    return columns


def plot(points, batches, write_points, pool_sizes, row_counts, serve_summary):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, max(3, len(batches)), figsize=(15, 8.5))
    styles = {"day3 gather": "o-", "MLX reference walk": "s--", ONE: "d-.", ALL: "D-",
              "mx.fast": "^:"}
    for ax, batch in zip(axes[0], batches, strict=False):
        pts = [p for p in points if p["batch"] == batch]
        for m in ATTN_METHODS:
            xs = [p["context"] for p in pts if p["ms"][m] is not None]
            ys = [p["ms"][m] for p in pts if p["ms"][m] is not None]
            if xs:
                ax.plot(xs, ys, styles[m], label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per decode attention call")
        ax.set_title(f"batch {batch}: one layer, 9q/3kv heads, d=64, fp32", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[0][len(batches):]:
        ax.axis("off")
    ax = axes[1][0]
    for m, style in zip(WRITE_METHODS, ("D-", "o-", "x:"), strict=True):
        for n in row_counts:
            pts = [p for p in write_points if p["rows"] == n and p["us"][m] is not None]
            ax.plot([p["pool_slots"] for p in pts], [p["us"][m] for p in pts], style,
                    label=f"{m}, {n} rows")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pool size (slots, one layer)")
    ax.set_ylabel("µs per write (K and V)")
    ax.set_title("KV write vs pool size", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1][1]
    names = list(serve_summary)
    labels = [n.replace(" (", "\n(").replace(", ", ",\n").replace("paged + ", "paged +\n")
              for n in names]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [serve_summary[n]["tok_per_s"] for n in names], 0.4, label="output tok/s")
    ax.bar(x + 0.2, [serve_summary[n]["decode_tok_per_s"] for n in names], 0.4,
           label="decode tok/s")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("tokens / s")
    ax.set_title("Serving progression", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1][2]
    ax.bar(x, [serve_summary[n]["gather_bytes_per_decode_step"] / 2**20
               + serve_summary[n]["pool_copy_bytes_per_decode_step"] / 2**20 for n in names])
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("MiB copied by attention per decode step")
    ax.set_title("Gathered rows + whole-pool copies per decode step", fontsize=10)
    for ax in axes[1][3:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--calls", type=int, default=None,
                    help="timed calls per method and round in parts 1-2 (default 3; quick: 2)")
    args = ap.parse_args()
    faulthandler.enable()
    blas_threads = openblas_threads()
    t_start = time.perf_counter()
    rounds = args.rounds
    calls = args.calls or (2 if args.quick else 3)
    warmup = 1
    if args.quick:
        batches, contexts = (1, 8), (128, 512)
        pool_sizes, row_counts = (1024, 16384), (8, 64)
        num_requests, prompt_range, output_range = 6, (20, 60), (8, 16)
    else:
        batches, contexts = (1, 8, 32), (128, 512, 2048, 8192)
        pool_sizes, row_counts = (1024, 16384, 131072, 524288), (8, 64)
        num_requests, prompt_range, output_range = 8, (100, 300), (32, 48)

    print(f"device: {bench_device()}; OpenBLAS threads: {blas_threads}; kernel threads "
          f"compared: {[threads_label(n) for n in KERNEL_THREADS]}", flush=True)
    points = attention_sweep(batches, contexts, warmup, rounds, calls)
    t_attention = time.perf_counter() - t_start
    write_points = write_sweep(pool_sizes, row_counts, warmup, rounds, calls)
    t_write = time.perf_counter() - t_start - t_attention

    model, tokenizer, model_name = load_model(args.quick)
    prompts, max_tokens = serve_workload(num_requests, prompt_range, output_range)
    max_model_len = -(-(prompt_range[1] + output_range[1]) // PAGE_SIZE) * PAGE_SIZE
    forward = forward_without_attention(model)
    # Warm every path up (graph caches, the extension, allocator) on a small run.
    serving_round(model, tokenizer, [p[:32] for p in prompts[:2]], [4, 4], max_model_len,
                  forward)
    serve_rounds, forward_ms = [], []
    for r in range(rounds):
        results, ms = serving_round(model, tokenizer, prompts, max_tokens, max_model_len,
                                    forward)
        serve_rounds.append(results)
        forward_ms.append(ms)
        print(f"serving round {r + 1}/{rounds} done", flush=True)
    t_serve = time.perf_counter() - t_start - t_attention - t_write
    names = list(SERVE_CONFIGS)
    base = names[0]
    mismatch = {n: sum(a != b for rnd in serve_rounds
                       for a, b in zip(rnd[n]["tokens"], rnd[base]["tokens"], strict=True))
                for n in names}
    same_tokens = not any(mismatch.values())
    timed = ("busy_s", "tok_per_s", "decode_tok_per_s", "decode_ms_per_step")
    summary: dict[str, dict[str, Any]] = {}
    for n in names:
        first = serve_rounds[0][n]
        summary[n] = {k: v for k, v in first.items() if k != "tokens" and k not in timed}
        for k in timed:
            s = spread([rnd[n][k] for rnd in serve_rounds])
            summary[n][k], summary[n][k + "_spread"] = s["median"], s

    def vs_base(n: str, key: str) -> float:
        return statistics.median(rnd[n][key] / rnd[base][key] for rnd in serve_rounds)

    tables = []
    columns = attention_columns()
    skipped = [f"B={p['batch']} L={p['context']}" for p in points if p["reference_skipped"]]
    worst_err = max(e for p in points for e in p["max_abs_err_vs_kernel"].values())
    if ON_CPU:
        threads_note = (
            "Threads: the vector kernel (paged_attention, tiled=False) with "
            "extension().set_num_threads(n) for each n compared (this machine has "
            f"{os.cpu_count()} cores; the pool splits a call only when it is large enough); "
            "mx.fast and the MLX ops run on MLX's one CPU stream thread, OpenBLAS on "
            f"{blas_threads} thread(s): '{ONE_SHORT} / mx.fast' is the equal-thread "
            "comparison. ")
    else:
        threads_note = f"Every path ran {gpu_words()}. "
    tables.append(Table(
        "1. Decode attention, one layer (9 q heads, 3 KV heads, d=64, float32, page_size 16, "
        "shuffled pages): ms per call",
        [h for h, _, _ in columns],
        [[get(p) for _, _, get in columns] for p in points],
        [f for _, f, _ in columns],
        note=(
            f"Median over {rounds} round(s) of the medians of {calls} interleaved calls, "
            f"after {warmup} warmup. day3 gather = per sequence PagePool.gather + "
            "causal_attention (Day 3's attend without its write); mx.fast runs on K/V "
            "gathered beforehand into [B, Hkv, L, D] (no gather cost). " + threads_note
            + "GB/s = bytes of K and V that must be read / time. Reference walk "
            + (f"skipped at {', '.join(skipped)} (B x L > {REF_MAX_KEYS})" if skipped
               else "run at every point")
            + f". All paths agree with the kernel to {worst_err:.1e} (max abs)."
        ),
    ))
    write_rows = []
    for p in write_points:
        us = p["us"]
        write_rows.append([p["pool_slots"], p["rows"], p["pool_bytes"] / 2**20,
                           us["extension"], us["day3 PagePool.write"],
                           us["extension, old pool kept"], p["extension_over_day3"],
                           p["pool_copies_per_call"]["extension"]])
    tables.append(Table(
        "2. KV write (K and V, one layer) vs pool size: µs per write",
        ["pool slots", "new rows", "K+V pool (MiB)", "extension (µs)",
         "day3 PagePool.write (µs)", "extension, old pool kept (µs)", "extension / day3",
         "extension pool copies / call"],
        write_rows,
        ["", "", ".1f", ".0f", ".0f", ".0f", ".2f", ".1f"],
        note=(
            "extension: paged_kv_write with the old pool references dropped before "
            "evaluation (the kernel backends' pattern); day3: PagePool.write (MLX indexed "
            "assignment, in place when the pool is donatable); 'old pool kept' is a control "
            f"that must copy (run up to {CONTROL_MAX_SLOTS} slots). Pool copies counted by "
            "extension().pool_copies() over the timed calls (2 per call = K and V"
            + ("" if ON_CPU else "; where the GPU decides the write is MLX's scatter, which "
               "counts none")
            + "). Median "
            f"over {rounds} round(s) of the medians of {calls} interleaved calls "
            f"({max(1, calls // 2)} for the control, which copies the pool)."
        ),
    ))
    tables.append(Table(
        "2b. Is the write O(new rows)? Time at the largest pool / time at the smallest",
        ["method", "new rows", "small pool (slots)", "large pool (slots)", "small (µs)",
         "large (µs)", "growth", "pool copies / call (large)", "verdict"],
        write_flatness(write_points, pool_sizes, row_counts),
        ["", "", "", "", ".0f", ".0f", ".1f", ".1f", ""],
        note=f"Pools grow {max(pool_sizes) // min(pool_sizes)}x; 'flat' means < 3x growth.",
    ))
    serve_rows = []
    for n in names:
        s = summary[n]
        serve_rows.append([
            n, s["tok_per_s"], s["decode_tok_per_s"], s["decode_ms_per_step"],
            vs_base(n, "tok_per_s"), vs_base(n, "decode_tok_per_s"),
            s["kv_cache_bytes"] / 2**20, s["peak_live_kv_bytes"] / 2**20,
            (s["gather_bytes_per_decode_step"] / 2**20
             if SERVE_CONFIGS[n].get("attention") not in (None, "page_walk") else None),
            (s["pool_copy_bytes_per_decode_step"] / 2**20 if n != "dense" else None),
            int(s["pool_copies"]), mismatch[n],
        ])
    lens = [len(p) for p in prompts]
    no_attention_ms = statistics.median(forward_ms)
    tables.append(Table(
        f"3. Serving progression: {num_requests} requests at t=0, {model_name}, "
        f"max_num_seqs={MAX_NUM_SEQS}",
        ["config", "output tok/s", "decode tok/s", "decode ms/step", "tok/s vs dense",
         "decode tok/s vs dense", "kv_cache_bytes (MiB)", "peak live K/V (MiB)",
         "gathered / decode step (MiB)", "pool copies / decode step (MiB)",
         "pool copies (total)", "requests with different tokens"],
        serve_rows,
        ["", ".1f", ".1f", ".0f", ".2f", ".2f", ".1f", ".1f", ".1f", ".1f", "", ""],
        note=(
            f"Prompts {min(lens)}-{max(lens)} random token ids ({sum(lens)} in all), "
            f"{sum(max_tokens)} output tokens ({min(max_tokens)}-{max(max_tokens)} each), "
            f"greedy, ignore_eos; max_model_len={max_model_len}, token budget 512, chunked "
            "prefill on, prefix caching off. decode = steps that compute no prompt token. "
            "kv_cache_bytes: engine.stats() (dense: the slot buffers allocated, which grow "
            "and are kept; paged: the pool); peak live K/V: tokens held by running requests "
            "x K/V bytes per token, all layers. gathered: context rows GatherAttention "
            "copies out of the pages, all layers, K and V (dense: none gathered — its "
            "attention reads a slice of the request's own buffer; the MLX reference walk "
            "copies page columns inside its ops, not counted here: '–'); pool copies: whole "
            "per-layer pool arrays copied by paged_kv_write (pool_copies() x one layer's "
            "pool). "
            + ("All configurations produced the same tokens."
               if same_tokens else "THE CONFIGURATIONS PRODUCED DIFFERENT TOKENS.")
            + " The engines ran side by side, taking turns step by step (rotating who "
            "goes first); tok/s = tokens / the sum of that engine's step times; medians of "
            f"{rounds} round(s), ratios the medians of per-round ratios. "
            + ("Kernel threads: extension().set_num_threads(n) around each of that engine's "
               "steps (the other engines' MLX ops run on one thread); every engine with "
               "cpu_kernels=False, so they differ in attention alone. " if ON_CPU else
               f"Every engine ran {gpu_words()}, so they differ in attention alone. ")
            + f"For scale: the model forward for "
            f"{MAX_NUM_SEQS} decode tokens with attention replaced by the identity, timed "
            f"once per turn alongside the engines, takes {no_attention_ms:.0f} ms (median)."
        ),
    ))
    data = {
        "quick": args.quick,
        "calls": calls,
        "openblas_threads": blas_threads,
        "kernel_threads": KERNEL_THREADS,
        "attention": {"batches": list(batches), "contexts": list(contexts),
                      "page_size": PAGE_SIZE, "heads": [N_HEADS, N_KV_HEADS, HEAD_DIM],
                      "reference_skipped": skipped, "points": points},
        "write": {"pool_sizes": list(pool_sizes), "row_counts": list(row_counts),
                  "points": write_points},
        "serving": {
            "model": model_name,
            "configs": SERVE_CONFIGS,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": max_model_len,
            "prompt_lens": lens,
            "max_tokens": max_tokens,
            "same_tokens": same_tokens,
            "summary": summary,
            "requests_with_different_tokens": mismatch,
            "forward_without_attention_ms": spread(forward_ms),
        },
        "phase_wall_s": {"attention": t_attention, "write": t_write, "serving": t_serve},
        "bench_wall_s": None,
    }
    fig = plot(points, batches, write_points, pool_sizes, row_counts, summary)
    data["bench_wall_s"] = time.perf_counter() - t_start
    save_results("bench_week3_day4" + ("_quick" if args.quick else ""), data, tables, fig,
                 rounds=rounds)
    print(f"bench wall time {data['bench_wall_s']:.0f} s (attention {t_attention:.0f} s, "
          f"write {t_write:.0f} s, serving {t_serve:.0f} s)")


if __name__ == "__main__":
    main()
