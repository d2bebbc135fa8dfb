"""Day 3: paged KV cache — admission capacity, fragmentation, prefix caching, and what the
Day 3 gather costs.

Five measurements, each comparing configurations side by side in one run:

1. **Memory-capped sweep** (admission capacity). For KV budgets that hold ``b`` sequences of
   ``max_model_len`` tokens (b = 2, 4, 8, 16), a dense reservation admits at most
   ``floor(budget / (max_model_len * bytes_per_token)) = b`` requests at once: the dense
   engine runs with ``max_num_seqs = b`` (it has no memory cap of its own; it reserves per
   slot). The paged engine gets ``num_pages = budget // page_bytes`` and ``max_num_seqs=32``.
   All engines of the sweep are stepped round-robin in one loop, so a noisy neighbour hurts
   them alike; an engine's time is the sum of its own step times. Concurrency is the number
   of running requests during each forward (running after the step + finished in it).
   (1a) runs the model; (1b) runs the full-size workload through the engine's own
   scheduler and block manager with fake tokens (``ContinuousBatchingScheduler``): exact
   concurrency and preemption counts, in steps, with no model.
2. **Fragmentation** (model-free): slots wasted by tail pages for page sizes 8..64 (and 256,
   the growth step of Day 1's ``DenseKVCache``) vs reserving ``max_model_len`` per sequence,
   on a skewed (log-normal) length distribution.
3. **Shared system prompt**: requests sharing a long system prompt, short distinct user
   suffixes, short outputs; paged with prefix caching on vs off, stepped alternately. TTFT
   is measured on each engine's own clock (all requests arrive at time 0).
4. **Cost of the gather** (the motivation for Day 4): one decode step's attention for one
   layer with SmolLM2's heads (9 q, 3 kv, head_dim 64, float32) through ``PagedBatchKV``
   (write + per-sequence gather + ``causal_attention``) vs ``causal_attention`` on
   pre-gathered contiguous K/V. Pages are assigned in a random order, as after churn.
5. **Cost of the page write** (``PagePool.write``: MLX indexed assignment) vs pool size, and
   the same write while a stray view of the pool is alive (which forces MLX to copy).

    python benches/bench_week3_day3.py           # SmolLM2-135M, a few minutes
    python benches/bench_week3_day3.py --quick   # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import fields
from typing import Any

from tiny_llm.day1_batching import ContinuousBatchingScheduler
from tiny_llm.day3_paged_kv import (
    BlockManager,
    PagedBatchKV,
    PagePool,
    kv_bytes_per_token,
    kv_cache_blocks_fragmentation,
)
from tiny_llm.engine import EngineConfig, LLMEngine
from tiny_llm.kv_cache import causal_attention
from tiny_llm.model import Model

import mlx.core as mx
import numpy as np
from common import Table, greedy, lap, load_model, measure, percentile, save_results

NAME = "bench_week3_day3"
PAGE_SIZE = 16
PAGED_MAX_SEQS = 32
SMOLLM_HEADS = (9, 3, 64)  # query heads, kv heads, head_dim

FULL = dict(
    # (1a) the model runs. Sized to fit ~8 minutes on a shared 2-core CPU: every length is
    # the (1b) workload scaled by 1/4 (max_model_len 256), so the reserved/used ratio of a
    # dense slot stays realistic; fewer requests and budgets.
    sweep_budgets=[2, 4, 8],
    sweep_max_model_len=256,
    sweep_requests=12,
    sweep_prompt=(12, 75),
    sweep_output=(4, 12),
    # (1b) the model-free sweep at full size
    sim_budgets=[2, 4, 8, 16],
    sim_requests=48,
    sim_prompt=(50, 300),
    sim_output=(20, 120),
    prefix_len=512,
    prefix_requests=6,
    prefix_suffix=(8, 32),
    prefix_output=2,
    gather_contexts=[128, 256, 512, 1024, 2048, 4096],
    gather_batches=[1, 8],
    write_pools=[1024, 16384, 131072, 524288],
    write_rows=[8, 64],
    frag_sequences=2000,
)
QUICK = dict(
    sweep_budgets=[2, 4, 8, 16],
    sim_budgets=[2, 4, 8, 16],
    sweep_max_model_len=256,
    sweep_requests=16,
    sweep_prompt=(12, 75),
    sweep_output=(4, 16),
    sim_requests=48,
    sim_prompt=(50, 300),
    sim_output=(20, 120),
    prefix_len=128,
    prefix_requests=8,
    prefix_suffix=(4, 16),
    prefix_output=4,
    gather_contexts=[128, 512, 1024],
    gather_batches=[1, 8],
    write_pools=[1024, 16384],
    write_rows=[8, 64],
    frag_sequences=500,
)


# ------------------------------------------------------------------ models and engines


def gather_option() -> dict[str, str]:
    """Day 3's attention path: the engine gathers K/V per sequence. (Day 4 adds an
    ``attention`` option whose default is its kernel; pin Day 3's path if it exists.)"""
    names = {f.name for f in fields(EngineConfig)}
    return {"attention": "gather"} if "attention" in names else {}


def random_prompts(rng: random.Random, n: int, lens: tuple[int, int],
                   vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lens))] for _ in range(n)]


class Run:
    """One engine in an interleaved run, with its own clock (the sum of its step times)."""

    def __init__(self, label: str, engine: LLMEngine):
        self.label, self.engine = label, engine
        self.busy = 0.0
        self.steps = 0
        self.running: list[int] = []  # requests running during each step's forward
        self.first_token_at: dict[str, float] = {}

    def step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        self.busy += time.perf_counter() - start
        self.steps += 1
        finished = sum(1 for o in outputs if o.finished)
        self.running.append(len(self.engine.scheduler.running) + finished)
        for out in outputs:
            self.first_token_at.setdefault(out.request_id, self.busy)


def run_interleaved(runs: list[Run]) -> None:
    """Step every unfinished engine in turn until all are done."""
    while True:
        active = [r for r in runs if r.engine.has_unfinished_requests()]
        if not active:
            return
        for run in active:
            run.step()


def warm_up(model: Model, tokenizer: Any) -> None:
    """First MLX calls are slow (thread pools, first shapes): run short requests once."""
    for kv in ("dense", "paged"):
        engine = LLMEngine(model, tokenizer, kv_cache=kv, num_pages=16, max_num_seqs=2,
                           max_model_len=128, **gather_option())
        engine.generate([list(range(1, 30)), list(range(5, 20))], greedy(2), use_tqdm=False)


# ------------------------------------------------------------------ 1. memory-capped sweep


def sweep_engine(model: Model, tokenizer: Any, sz: dict[str, Any]) -> list[dict[str, Any]]:
    max_len = sz["sweep_max_model_len"]
    bpt = kv_bytes_per_token(model.config, model.dtype)
    rng = random.Random(1)
    prompts = random_prompts(rng, sz["sweep_requests"], sz["sweep_prompt"],
                             model.config.vocab_size)
    outputs = [rng.randint(*sz["sweep_output"]) for _ in prompts]
    runs, meta = [], []
    for b in sz["sweep_budgets"]:
        budget = b * max_len * bpt
        dense_seqs = budget // (max_len * bpt)
        num_pages = budget // (PAGE_SIZE * bpt)
        common_opts = dict(max_model_len=max_len, max_num_batched_tokens=512,
                           enable_prefix_caching=False)
        for kind, opts in (
            ("dense", dict(kv_cache="dense", max_num_seqs=dense_seqs)),
            ("paged", dict(kv_cache="paged", max_num_seqs=PAGED_MAX_SEQS, page_size=PAGE_SIZE,
                           num_pages=num_pages, **gather_option())),
        ):
            engine = LLMEngine(model, tokenizer, **common_opts, **opts)
            for p, n in zip(prompts, outputs, strict=True):
                engine.add_request(p, greedy(n))
            runs.append(Run(f"{kind}@{b}", engine))
            meta.append(dict(budget_seqs=b, budget_mib=budget / 2**20, kind=kind,
                             max_num_seqs=opts["max_num_seqs"],
                             num_pages=num_pages if kind == "paged" else None))
    run_interleaved(runs)
    results = []
    for run, m in zip(runs, meta, strict=True):
        s = run.engine.stats()
        results.append(dict(
            **m,
            max_running=max(run.running),
            mean_running=statistics.fmean(run.running),
            steps=run.steps,
            seconds=run.busy,
            generated=s["num_generated_tokens"],
            tok_per_s=s["num_generated_tokens"] / run.busy,
            preemptions=s["num_preemptions"],
            prompt_tokens_computed=s["num_prompt_tokens_computed"],
            kv_cache_bytes=s["kv_cache_bytes"],
            running_per_step=run.running,
        ))
    return results


def noise_check(rows: list[dict[str, Any]]) -> str:
    """Runs with identical schedules (same batch at every step: the pool never bound) did
    the same work; the spread of their times is this run's noise floor."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["kind"], tuple(r["running_per_step"])), []).append(r)
    parts = []
    for (kind, _), same in groups.items():
        if len(same) > 1:
            times = [r["seconds"] for r in same]
            budgets = ", ".join(str(r["budget_seqs"]) for r in same)
            parts.append(f"{kind} at budgets {budgets} ran identical schedules yet took "
                         f"{' / '.join(f'{t:.1f}' for t in times)} s "
                         f"(max/min {max(times) / min(times):.2f})")
    if not parts:
        return ""
    return " Noise floor: " + "; ".join(parts) + "."


def sweep_simulated(sz: dict[str, Any], max_len: int = 1024) -> list[dict[str, Any]]:
    """The full-size workload through the engine's Scheduler and BlockManager, no model."""
    rng = random.Random(2)
    reqs = [(rng.randint(*sz["sim_prompt"]), rng.randint(*sz["sim_output"]))
            for _ in range(sz["sim_requests"])]
    results = []
    for b in sz["sim_budgets"]:
        tokens = b * max_len
        for kind in ("dense", "paged"):
            if kind == "dense":
                sim = ContinuousBatchingScheduler(b, max_num_batched_tokens=512)
            else:
                blocks = BlockManager(tokens // PAGE_SIZE, PAGE_SIZE)
                sim = ContinuousBatchingScheduler(PAGED_MAX_SEQS, blocks,
                                                  max_num_batched_tokens=512)
            for i, (p, o) in enumerate(reqs):
                sim.add_request(p, o, prompt_token_ids=[10_000 * (i + 1) + j for j in range(p)])
            running = [r.num_running + len(r.finished) for r in sim.run()]
            results.append(dict(budget_seqs=b, kind=kind, steps=len(running),
                                max_running=max(running), mean_running=statistics.fmean(running),
                                preemptions=sim.scheduler.num_preemptions))
    return results


def sweep_tables(engine_rows: list[dict[str, Any]], sim_rows: list[dict[str, Any]],
                 sz: dict[str, Any], model_name: str) -> list[Table]:
    by = {(r["budget_seqs"], r["kind"]): r for r in engine_rows}
    rows = []
    for b in sz["sweep_budgets"]:
        d, p = by[b, "dense"], by[b, "paged"]
        rows.append([b, d["budget_mib"], d["max_running"], p["max_running"],
                     d["mean_running"], p["mean_running"], d["tok_per_s"], p["tok_per_s"],
                     p["tok_per_s"] / d["tok_per_s"], d["preemptions"], p["preemptions"],
                     d["seconds"], p["seconds"]])
    t1 = Table(
        f"1a. Memory-capped sweep, {model_name}: dense reservation vs paged "
        f"(max_model_len={sz['sweep_max_model_len']}, {sz['sweep_requests']} requests, "
        f"prompts {sz['sweep_prompt'][0]}-{sz['sweep_prompt'][1]}, outputs "
        f"{sz['sweep_output'][0]}-{sz['sweep_output'][1]} tokens, greedy, ignore_eos)",
        ["budget (seqs @ max len)", "budget MiB", "max running dense", "max running paged",
         "mean running dense", "mean running paged", "dense tok/s", "paged tok/s",
         "paged/dense tok/s", "preempt dense", "preempt paged", "dense s", "paged s"],
        rows,
        ["", ".1f", "", "", ".1f", ".1f", ".2f", ".2f", ".2f", "", "", ".1f", ".1f"],
        f"Dense admits floor(budget / (max_model_len x bytes/token)) requests (its "
        f"max_num_seqs); paged gets budget // page bytes pages (page_size={PAGE_SIZE}) and "
        f"max_num_seqs={PAGED_MAX_SEQS}. Paged attention is Day 3's gather path. All engines "
        "were stepped round-robin in one loop; seconds are each engine's own step time."
        + noise_check(engine_rows),
    )
    sim = {(r["budget_seqs"], r["kind"]): r for r in sim_rows}
    rows = []
    for b in sz["sim_budgets"]:
        d, p = sim[b, "dense"], sim[b, "paged"]
        rows.append([b, d["max_running"], p["max_running"], d["mean_running"],
                     p["mean_running"], d["steps"], p["steps"], d["steps"] / p["steps"],
                     p["preemptions"]])
    t2 = Table(
        f"1b. The same sweep at full size, model-free (engine's Scheduler + BlockManager, "
        f"fake tokens): max_model_len=1024, {sz['sim_requests']} requests, prompts "
        f"{sz['sim_prompt'][0]}-{sz['sim_prompt'][1]}, outputs "
        f"{sz['sim_output'][0]}-{sz['sim_output'][1]}",
        ["budget (seqs)", "max running dense", "max running paged", "mean running dense",
         "mean running paged", "steps dense", "steps paged", "steps dense/paged",
         "preempt paged"],
        rows,
        ["", "", "", ".1f", ".1f", "", "", ".2f", ""],
        "Steps are forwards. A step's cost grows with the number of sequences in it (Day 3 "
        "loops over sequences in every layer), so the step ratio is an upper bound on the "
        "throughput ratio.",
    )
    return [t1, t2]


# ------------------------------------------------------------------ 2. fragmentation


def fragmentation(sz: dict[str, Any], max_len: int = 1024) -> tuple[list[dict[str, Any]], Table]:
    rng = np.random.default_rng(3)
    # Skewed: log-normal lengths (median ~150 tokens, a long tail), clipped to max_len.
    lens = np.clip(rng.lognormal(math.log(150), 0.9, sz["frag_sequences"]), 1, max_len)
    lens = [int(x) for x in lens]
    rows, data = [], []
    for ps in (8, 16, 32, 64, 256):
        f = kv_cache_blocks_fragmentation(lens, ps, max_len)
        rows.append([ps, f.paged_fraction, f.dense_fraction,
                     f.dense_total_slots / f.paged_total_slots])
        data.append(dict(page_size=ps, paged_wasted=f.paged_wasted_slots,
                         paged_total=f.paged_total_slots, paged_fraction=f.paged_fraction,
                         dense_wasted=f.dense_wasted_slots, dense_total=f.dense_total_slots,
                         dense_fraction=f.dense_fraction))
    table = Table(
        f"2. Fragmentation, {len(lens)} sequences with log-normal lengths (median "
        f"{int(statistics.median(lens))}, mean {statistics.fmean(lens):.0f}, max {max(lens)}) "
        f"vs dense reservation at max_model_len={max_len}",
        ["page size", "paged: wasted slot fraction", "dense: wasted slot fraction",
         "slots dense / slots paged"],
        rows,
        ["", ".3f", ".3f", ".1f"],
        "Page size 256 is the growth step of Day 1's DenseKVCache: its real footprint is "
        "paged-like, but it cannot be capped or shared, so admission must assume max_model_len.",
    )
    return data, table


# ------------------------------------------------------------------ 3. shared system prompt


def prefix_sharing(model: Model, tokenizer: Any, sz: dict[str, Any]) -> tuple[dict, Table]:
    rng = random.Random(4)
    vocab = model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(sz["prefix_len"])]
    suffixes = random_prompts(rng, sz["prefix_requests"], sz["prefix_suffix"], vocab)
    prompts = [system + s for s in suffixes]
    longest = max(map(len, prompts)) + sz["prefix_output"]
    num_pages = len(prompts) * -(-longest // PAGE_SIZE) + 8
    runs = []
    for caching in (False, True):
        engine = LLMEngine(model, tokenizer, kv_cache="paged", page_size=PAGE_SIZE,
                           num_pages=num_pages, max_num_seqs=PAGED_MAX_SEQS,
                           max_model_len=max(1024, longest), enable_prefix_caching=caching,
                           **gather_option())
        for p in prompts:
            engine.add_request(p, greedy(sz["prefix_output"]))
        runs.append(Run("on" if caching else "off", engine))
    run_interleaved(runs)
    data = {}
    rows = []
    for run in runs:
        s = run.engine.stats()
        ttft = sorted(run.first_token_at.values())
        d = dict(
            ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
            prompt_tokens=sum(map(len, prompts)),
            prompt_tokens_computed=s["num_prompt_tokens_computed"],
            hit_rate=s["prefix_cache_hit_tokens"] / max(1, s["prefix_cache_query_tokens"]),
            seconds=run.busy, steps=run.steps, ttft=ttft,
        )
        data[run.label] = d
        rows.append([run.label, d["ttft_p50"], d["ttft_p99"], d["prompt_tokens"],
                     d["prompt_tokens_computed"], d["hit_rate"], d["seconds"]])
    off, on = data["off"], data["on"]
    rows.append(["off/on", off["ttft_p50"] / on["ttft_p50"], off["ttft_p99"] / on["ttft_p99"],
                 None, round(off["prompt_tokens_computed"] / on["prompt_tokens_computed"], 2),
                 None,
                 off["seconds"] / on["seconds"]])
    table = Table(
        f"3. Shared system prompt ({sz['prefix_len']} tokens) x {len(prompts)} requests "
        f"(suffixes {sz['prefix_suffix'][0]}-{sz['prefix_suffix'][1]} tokens, "
        f"{sz['prefix_output']} output tokens), paged, prefix caching off vs on",
        ["prefix caching", "TTFT p50 (s)", "TTFT p99 (s)", "prompt tokens",
         "prefill tokens computed", "hit rate", "total s"],
        rows,
        ["", ".2f", ".2f", "", "", ".3f", ".1f"],
        "All requests arrive at once; TTFT is on each engine's own clock (sum of its step "
        "times), the two engines being stepped alternately. Hit rate = prefix-cache hit "
        "tokens / queried prompt tokens.",
    )
    return data, table


# ------------------------------------------------------------------ 4. cost of the gather


def interleaved(fns: dict[str, Any], rounds: int = 3, repeats: int = 3,
                warmup: int = 1) -> dict[str, float]:
    """Median over rounds of ``measure`` medians, the configurations alternating per round."""
    got: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name].append(measure(fn, warmup=warmup, repeats=repeats).median)
    return {k: statistics.median(v) for k, v in got.items()}


def gather_cost(sz: dict[str, Any], num_layers: int = 30) -> tuple[list[dict], Table]:
    hq, hkv, hd = SMOLLM_HEADS
    scale = hd**-0.5
    rng = random.Random(5)
    data, rows = [], []
    for batch in sz["gather_batches"]:
        for ctx in sz["gather_contexts"]:
            pages_per_seq = -(-ctx // PAGE_SIZE)
            num_pages = batch * pages_per_seq + 16
            pool = PagePool(1, num_pages, PAGE_SIZE, hkv, hd, mx.float32)
            # Fill the pool with data (writes through the pool's own API).
            all_slots = mx.arange(num_pages * PAGE_SIZE, dtype=mx.int32)
            rows_kv = mx.random.normal((num_pages * PAGE_SIZE, hkv, hd))
            pool.write(0, all_slots, rows_kv, rows_kv * 0.5)
            mx.eval(pool.k, pool.v)
            order = list(range(num_pages))
            rng.shuffle(order)  # pages scattered, as after a while of allocation churn
            context_slots = []
            for b in range(batch):
                table = order[b * pages_per_seq:(b + 1) * pages_per_seq]
                context_slots.append([table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
                                      for p in range(ctx)])
            slot_mapping = [s[-1] for s in context_slots]  # the decode token at ctx - 1
            paged = PagedBatchKV(pool, slot_mapping, list(range(batch + 1)), context_slots)
            q = mx.random.normal((batch, hq, hd))
            k_new = mx.random.normal((batch, hkv, hd))
            v_new = mx.random.normal((batch, hkv, hd))
            slot_arrays = [mx.array(s, dtype=mx.int32) for s in context_slots]
            dense_k = [pool.k[0].reshape(-1, hkv, hd)[s] for s in slot_arrays]
            dense_v = [pool.v[0].reshape(-1, hkv, hd)[s] for s in slot_arrays]
            mx.eval(q, k_new, v_new, dense_k, dense_v)

            def paged_step(paged=paged, q=q, k_new=k_new, v_new=v_new):
                return paged.attend(0, q, k_new, v_new, scale)

            def dense_step(q=q, dk=dense_k, dv=dense_v, ctx=ctx):
                outs = [causal_attention(q[b:b + 1], dk[b], dv[b], scale, ctx - 1)
                        for b in range(len(dk))]
                return outs[0] if len(outs) == 1 else mx.concatenate(outs)

            def gather_only(pool=pool, slots=slot_arrays):
                if hasattr(pool, "gather"):
                    return [pool.gather(0, s) for s in slots]
                return [(pool.k[0][s], pool.v[0][s]) for s in slots]

            t = interleaved({"paged": paged_step, "dense": dense_step, "gather": gather_only},
                            rounds=5, repeats=5)
            copied = batch * ctx * hkv * hd * 4 * 2
            d = dict(batch=batch, context=ctx, paged_s=t["paged"], dense_s=t["dense"],
                     gather_s=t["gather"], share=(t["paged"] - t["dense"]) / t["paged"],
                     gather_alone_share=t["gather"] / t["paged"],
                     bytes_per_layer=copied, bytes_per_step=copied * num_layers,
                     gather_gb_s=copied / t["gather"] / 1e9)
            data.append(d)
            rows.append([batch, ctx, d["paged_s"] * 1e3, d["dense_s"] * 1e3, d["gather_s"] * 1e3,
                         d["share"], d["gather_alone_share"], d["paged_s"] / d["dense_s"],
                         copied / 2**20,
                         copied * num_layers / 2**20, d["gather_gb_s"]])
            del pool, paged
    table = Table(
        "4. One decode step's attention, one layer, SmolLM2 heads (9 q / 3 kv / 64, float32): "
        "PagedBatchKV (write + per-sequence gather + causal_attention) vs causal_attention on "
        "pre-gathered contiguous K/V",
        ["batch", "context", "paged ms", "dense ms", "gather alone ms",
         "gather share (paged-dense)/paged", "gather alone / paged", "paged/dense",
         "MiB copied / layer", f"MiB copied / step ({num_layers} layers)",
         "gather GB/s"],
        rows,
        ["", "", ".3f", ".3f", ".3f", ".2f", ".2f", ".2f", ".2f", ".0f", ".2f"],
        "Gather share = (paged - dense) / paged, i.e. write + gather; 'gather alone' times "
        "the per-sequence gathers by themselves. Bytes copied = batch x context x kv_heads x "
        "head_dim x 4 B x 2 (K and V), per layer; a full SmolLM2 decode step copies 30x that.",
    )
    return data, table


# ------------------------------------------------------------------ 5. cost of the page write


def write_cost(sz: dict[str, Any]) -> tuple[list[dict], Table]:
    _, hkv, hd = SMOLLM_HEADS
    rng = random.Random(6)
    data, rows = [], []
    for pool_slots in sz["write_pools"]:
        pool = PagePool(1, pool_slots // PAGE_SIZE, PAGE_SIZE, hkv, hd, mx.float32)
        for n in sz["write_rows"]:
            slots = mx.array(rng.sample(range(pool_slots), n), dtype=mx.int32)
            k, v = mx.random.normal((n, hkv, hd)), mx.random.normal((n, hkv, hd))
            mx.eval(slots, k, v)

            def write(pool=pool, slots=slots, k=k, v=v):
                pool.write(0, slots, k, v)
                return pool.k + pool.v

            held: list[mx.array] = []

            def write_with_view(pool=pool, slots=slots, k=k, v=v, held=held):
                held.clear()  # last call's views die here, after their eval
                held.extend(a.reshape(-1) for a in pool.k + pool.v)
                mx.eval(held)  # views sharing the pool's buffer, as a stray reference would
                pool.write(0, slots, k, v)
                return pool.k + pool.v

            before = buffer_address(pool.k[0])
            t_in = interleaved({"w": write}, rounds=3, repeats=5)["w"]
            in_place = buffer_address(pool.k[0]) == before
            big = pool_slots >= 131072
            # A whole-pool copy per call: one timed call is plenty for the big pools.
            t_view = interleaved({"w": write_with_view}, rounds=1 if big else 2,
                                 repeats=1 if big else 3, warmup=0 if big else 1)["w"]
            held.clear()
            pool_mib = 2 * pool.k[0].nbytes / 2**20
            d = dict(pool_slots=pool_slots, rows=n, pool_mib=pool_mib, in_place_s=t_in,
                     same_buffer=in_place, with_view_s=t_view)
            data.append(d)
            rows.append([pool_slots, pool_mib, n, t_in * 1e6, "yes" if in_place else "NO",
                         t_view * 1e6, t_view / t_in])
        del pool
    table = Table(
        "5. PagePool.write (MLX indexed assignment, K and V, one layer) vs pool size",
        ["pool slots", "pool MiB (K+V)", "new rows", "write µs", "same buffer after",
         "write µs, stray view alive", "view/no view"],
        rows,
        ["", ".1f", "", ".1f", "", ".0f", ".0f"],
        "Same buffer: the pool's data pointer is unchanged after the writes (MLX donated the "
        "buffer to the scatter). With a stray view (an evaluated reshape of the pool) alive, "
        "MLX must keep the old buffer, so every write copies the whole pool.",
    )
    return data, table


def buffer_address(a: mx.array) -> int:
    view = np.asarray(a)  # zero-copy view of the evaluated buffer, dropped on return
    return view.__array_interface__["data"][0]


# ------------------------------------------------------------------ figure and main


def make_figure(sweep: list[dict], sim: list[dict], frag: list[dict], gather: list[dict],
                writes: list[dict]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0][0]
    for rows, style, tag in ((sweep, "-o", "engine"), (sim, "--s", "model-free, full size")):
        for kind, color in (("dense", "tab:red"), ("paged", "tab:blue")):
            pts = [(r["budget_seqs"], r["max_running"]) for r in rows if r["kind"] == kind]
            ax.plot(*zip(*pts, strict=True), style, color=color, label=f"{kind} ({tag})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget (sequences at max_model_len)")
    ax.set_ylabel("max requests running at once")
    ax.set_title("Admission capacity vs KV budget")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    ps = [r["page_size"] for r in frag]
    ax.plot(ps, [r["paged_fraction"] for r in frag], "-o", label="paged (tail pages)")
    ax.axhline(frag[0]["dense_fraction"], color="tab:red", ls="--",
               label="dense reservation at max_model_len")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size (tokens)")
    ax.set_ylabel("wasted slot fraction")
    ax.set_title("Fragmentation vs page size")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    for batch in sorted({r["batch"] for r in gather}):
        pts = [(r["context"], r["share"]) for r in gather if r["batch"] == batch]
        line, = ax.plot(*zip(*pts, strict=True), "-o", label=f"batch {batch}: (paged-dense)/paged")
        pts = [(r["context"], r["gather_alone_share"]) for r in gather if r["batch"] == batch]
        ax.plot(*zip(*pts, strict=True), "--x", color=line.get_color(),
                label=f"batch {batch}: gather alone / paged")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("gather share of attention time")
    ax.set_title("Day 3 gather: share of a decode step's attention (one layer)")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    for n in sorted({r["rows"] for r in writes}):
        pts = [(r["pool_slots"], r["in_place_s"] * 1e6) for r in writes if r["rows"] == n]
        ax.plot(*zip(*pts, strict=True), "-o", label=f"{n} rows")
        pts = [(r["pool_slots"], r["with_view_s"] * 1e6) for r in writes if r["rows"] == n]
        ax.plot(*zip(*pts, strict=True), "--x", label=f"{n} rows, stray view alive")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pool size (slots)")
    ax.set_ylabel("write time (µs)")
    ax.set_title("PagePool.write vs pool size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    args = ap.parse_args()
    sz = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    model, tokenizer, model_name = load_model(args.quick, vocab_size=512)
    warm_up(model, tokenizer)
    t = lap(timings, "load+warmup", t_start)

    frag_data, frag_table = fragmentation(sz)
    sim_rows = sweep_simulated(sz)
    t = lap(timings, "fragmentation+simulation", t)
    write_data, write_table = write_cost(sz)
    t = lap(timings, "page write", t)
    gather_data, gather_table = gather_cost(sz)
    t = lap(timings, "gather", t)
    prefix_data, prefix_table = prefix_sharing(model, tokenizer, sz)
    t = lap(timings, "prefix caching", t)
    sweep_rows = sweep_engine(model, tokenizer, sz)
    t = lap(timings, "memory-capped sweep", t)

    tables = [*sweep_tables(sweep_rows, sim_rows, sz, model_name), frag_table, prefix_table,
              gather_table, write_table]
    timings["total"] = time.perf_counter() - t_start
    data = dict(model=model_name, sizes=sz, page_size=PAGE_SIZE,
                kv_bytes_per_token=kv_bytes_per_token(model.config, model.dtype),
                sweep=sweep_rows, sweep_simulated=sim_rows, fragmentation=frag_data,
                prefix_caching=prefix_data, gather=gather_data, page_write=write_data,
                seconds=timings)
    fig = make_figure(sweep_rows, sim_rows, frag_data, gather_data, write_data)
    save_results(NAME + ("_quick" if args.quick else ""), data, tables, fig)
    print(f"total {timings['total']:.0f} s")


if __name__ == "__main__":
    main()
