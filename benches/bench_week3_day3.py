"""Day 3: paged KV cache — what paging gains (capacity: requests and tokens that fit in the
same KV memory) and what the Day 3 gather costs (latency), with fragmentation, prefix
caching and the page write.

Measurements, each comparing its configurations side by side in one run:

1. **Capacity at equal KV memory** (engine, the model runs). For KV budgets that hold ``b``
   sequences of ``max_model_len`` tokens, three engines serve the same requests, all of
   which start with the same system prompt (then a random suffix; greedy, ``ignore_eos``):

   - ``dense``: a dense reservation admits ``floor(budget / (max_model_len x
     bytes/token)) = b`` requests at once (``kv_cache="dense"``, ``max_num_seqs=b``; it has
     no memory cap of its own: it reserves per slot);
   - ``paged``: ``num_pages = budget // page_bytes``, ``max_num_seqs=32``, Day 3's gather
     attention, prefix caching off;
   - ``paged + prefix sharing``: the same with ``enable_prefix_caching=True``: requests
     share the system prompt's full pages (reference counts), so each holds fewer pages.

   Reported per budget and engine: the most and the mean requests running at once
   (running during each forward), the peak tokens held by running requests (their computed
   tokens: logical K/V), that peak over the budget's token slots, preemptions, prompt
   tokens computed, and output tok/s on the engine's own clock (the engines are stepped
   round-robin in one loop; an engine's time is the sum of its own step times).
   (1b) runs a full-size workload through the engine's own schedulers and block manager
   with fake tokens (``BatchingSimulator``, ``PagedBatchingSimulator``): exact
   concurrency, tokens held and preemptions, with no model.
2. **Latency at equal batch**: a dense engine and a paged engine with Day 3's gather
   (``attention="gather"``, pages never short, prefix caching off) serve the same ``b``
   requests with ``max_num_seqs=b``: identical schedules, so the difference in decode-step
   time (median over steps that compute no prompt token) is the cost of the paged path.
   The summary table puts it next to the capacity of (1): paging's gain is capacity; per
   step it is not faster.
3. **Fragmentation** (model-free): slots wasted by tail pages for page sizes 8..64 (and
   256, the growth step of Day 1's ``DenseKVCache``) vs reserving ``max_model_len`` per
   sequence, on a skewed (log-normal) length distribution.
4. **Shared system prompt**: requests sharing a long system prompt, short distinct user
   suffixes, short outputs; paged with prefix caching on vs off, stepped alternately. TTFT
   is measured on each engine's own clock (all requests arrive at time 0).
5. **Cost of the gather** (the motivation for Day 4): one decode step's attention for one
   layer with SmolLM2's heads (9 q, 3 kv, head_dim 64, float32) through
   ``GatherAttention.attend`` (page write + per-sequence gather + ``causal_attention``) vs
   ``causal_attention`` on pre-gathered contiguous K/V. Pages are assigned in a random
   order, as after churn.
6. **Cost of the page write** (``PagePool.write``: MLX indexed assignment) vs pool size,
   and the same write while a stray view of the pool is alive (which forces MLX to copy).

The engine measurements (1, 2, 4) run once per round, ``--rounds`` rounds (default 3),
medians reported (counts of requests and tokens do not vary between rounds: checked); the
microbenchmarks (5, 6) take the median over ``--rounds`` interleaved rounds of medians.

    python benches/bench_week3_day3.py           # SmolLM2-135M, about 30 minutes on 2 cores
    python benches/bench_week3_day3.py --quick   # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import math
import random
import statistics
import time
from types import SimpleNamespace
from typing import Any

from tiny_llm import LLMEngine, Model, PagedLayout, StepBatch, causal_attention, kv_bytes_per_token
from tiny_llm.day1_batching import BatchingSimulator, Scheduler
from tiny_llm.day2_chunked_prefill import ChunkedPrefillScheduler
from tiny_llm.day3_paged_kv import (
    BlockManager,
    GatherAttention,
    PagedBatchingSimulator,
    PagedKVStorage,
    PagePool,
    kv_cache_blocks_fragmentation,
    slots_for,
)
from tiny_llm.testing.paged import block_table

import mlx.core as mx
import numpy as np
from common import (
    Table,
    bench_parser,
    greedy,
    lap,
    load_model,
    measure,
    percentile,
    save_results,
    spread,
)

NAME = "bench_week3_day3"
PAGE_SIZE = 16
PAGED_MAX_SEQS = 32
SMOLLM_HEADS = (9, 3, 64)  # query heads, kv heads, head_dim
CAPACITY_CONFIGS = ("dense", "paged", "paged + prefix sharing")

FULL = dict(
    # (1) the model runs; lengths are the (1b) workload scaled by 1/4 (max_model_len 256),
    # so the reserved/used ratio of a dense slot stays realistic.
    sweep_budgets=[2, 4],
    sweep_max_model_len=256,
    sweep_requests=16,
    sweep_prefix=32,
    sweep_suffix=(12, 60),
    sweep_output=(4, 12),
    # (1b) the model-free sweep at full size
    sim_budgets=[2, 4, 8, 16],
    sim_requests=48,
    sim_prefix=128,
    sim_suffix=(50, 300),
    sim_output=(20, 120),
    latency_prompt=(64, 128),
    latency_output=16,
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
    sweep_budgets=[2, 4, 8],
    sweep_max_model_len=256,
    sweep_requests=16,
    sweep_prefix=32,
    sweep_suffix=(12, 60),
    sweep_output=(4, 16),
    sim_budgets=[2, 4, 8, 16],
    sim_requests=48,
    sim_prefix=128,
    sim_suffix=(50, 300),
    sim_output=(20, 120),
    latency_prompt=(32, 64),
    latency_output=8,
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
        self.held: list[int] = []  # tokens held by running requests after each step
        self.decode_times: list[float] = []  # steps that computed no prompt token
        self.first_token_at: dict[str, float] = {}

    def step(self) -> None:
        engine = self.engine
        prompt_before = engine.stats()["num_prompt_tokens_computed"]
        start = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - start
        self.busy += dt
        self.steps += 1
        stats = engine.stats()
        if stats["num_prompt_tokens_computed"] == prompt_before:
            self.decode_times.append(dt)
        finished = sum(1 for o in outputs if o.finished)
        self.running.append(stats["num_running"] + finished)
        self.held.append(sum(r.num_computed_tokens for r in engine.scheduler.running))
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
        extra = dict(num_pages=16, attention="gather") if kv == "paged" else {}
        engine = LLMEngine(model, tokenizer, kv_cache=kv, max_num_seqs=2, max_model_len=128,
                           **extra)
        engine.generate([list(range(1, 30)), list(range(5, 20))], greedy(2), use_tqdm=False)


# ------------------------------------------------------------------ 1. capacity


def capacity_workload(sz: dict[str, Any], vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    system = [rng.randrange(vocab) for _ in range(sz["sweep_prefix"])]
    prompts = [system + s for s in random_prompts(rng, sz["sweep_requests"],
                                                  sz["sweep_suffix"], vocab)]
    return prompts, [rng.randint(*sz["sweep_output"]) for _ in prompts]


def capacity_engines(model: Model, tokenizer: Any, sz: dict[str, Any]) -> list[dict[str, Any]]:
    """One round of (1): every budget and configuration, stepped round-robin."""
    max_len = sz["sweep_max_model_len"]
    bpt = kv_bytes_per_token(model.config, model.dtype)
    prompts, outputs = capacity_workload(sz, model.config.vocab_size)
    runs, meta = [], []
    for b in sz["sweep_budgets"]:
        budget = b * max_len * bpt
        num_pages = budget // (PAGE_SIZE * bpt)
        opts = {
            "dense": dict(kv_cache="dense", max_num_seqs=budget // (max_len * bpt)),
            "paged": dict(kv_cache="paged", attention="gather", max_num_seqs=PAGED_MAX_SEQS,
                          page_size=PAGE_SIZE, num_pages=num_pages, enable_prefix_caching=False),
            "paged + prefix sharing": dict(kv_cache="paged", attention="gather",
                                           max_num_seqs=PAGED_MAX_SEQS, page_size=PAGE_SIZE,
                                           num_pages=num_pages, enable_prefix_caching=True),
        }
        for kind in CAPACITY_CONFIGS:
            engine = LLMEngine(model, tokenizer, max_model_len=max_len,
                               max_num_batched_tokens=512, **opts[kind])
            for p, n in zip(prompts, outputs, strict=True):
                engine.add_request(p, greedy(n))
            runs.append(Run(f"{kind}@{b}", engine))
            meta.append(dict(budget_seqs=b, budget_mib=budget / 2**20, kind=kind,
                             budget_tokens=b * max_len,
                             max_num_seqs=opts[kind]["max_num_seqs"],
                             num_pages=num_pages if kind != "dense" else None))
    run_interleaved(runs)
    results = []
    for run, m in zip(runs, meta, strict=True):
        s = run.engine.stats()
        results.append(dict(
            **m,
            max_running=max(run.running),
            mean_running=statistics.fmean(run.running),
            peak_tokens_held=max(run.held),
            steps=run.steps,
            seconds=run.busy,
            generated=s["num_generated_tokens"],
            tok_per_s=s["num_generated_tokens"] / run.busy,
            preemptions=s["num_preemptions"],
            prompt_tokens_computed=s["num_prompt_tokens_computed"],
            prefix_hit_tokens=s.get("prefix_cache_hit_tokens", 0),
            running_per_step=run.running,
        ))
    return results


class DenseSimulator(BatchingSimulator):
    """The dense engine's scheduler (Day 2's, chunked) with ``max_batch`` slots, no model."""

    def make_scheduler(self, max_batch: int, max_num_batched_tokens: int,
                       policy: str) -> Scheduler:
        return ChunkedPrefillScheduler(max_batch, max_num_batched_tokens, policy)


def capacity_simulated(sz: dict[str, Any], max_len: int = 1024) -> list[dict[str, Any]]:
    """The full-size workload through the engine's schedulers and BlockManager, no model."""
    rng = random.Random(2)
    system = [rng.randrange(1, 50_000) for _ in range(sz["sim_prefix"])]
    reqs = []
    for i in range(sz["sim_requests"]):
        n = rng.randint(*sz["sim_suffix"])
        reqs.append((system + [100_000 * (i + 1) + j for j in range(n)],
                     rng.randint(*sz["sim_output"])))
    results = []
    for b in sz["sim_budgets"]:
        tokens = b * max_len
        for kind in CAPACITY_CONFIGS:
            if kind == "dense":
                sim = DenseSimulator(b, max_num_batched_tokens=512)
            else:
                blocks = BlockManager(tokens // PAGE_SIZE, PAGE_SIZE,
                                      enable_prefix_caching=kind != "paged")
                sim = PagedBatchingSimulator(PAGED_MAX_SEQS, blocks,
                                                  max_num_batched_tokens=512)
            for prompt, out in reqs:
                sim.add_request(len(prompt), out, prompt_token_ids=prompt)
            running, held = [], []
            while sim.scheduler.has_unfinished():
                report = sim.step()
                running.append(report.num_running + len(report.finished))
                held.append(sum(r.num_computed_tokens for r in sim.scheduler.running))
            results.append(dict(budget_seqs=b, kind=kind, budget_tokens=tokens,
                                steps=len(running), max_running=max(running),
                                mean_running=statistics.fmean(running),
                                peak_tokens_held=max(held),
                                preemptions=getattr(sim.scheduler, "num_preemptions", 0)))
    return results


# ------------------------------------------------------------------ 2. latency at equal batch


def latency_engines(model: Model, tokenizer: Any, sz: dict[str, Any]) -> list[dict[str, Any]]:
    """One round of (2): dense vs paged + gather at batch b, identical schedules."""
    rng = random.Random(7)
    vocab = model.config.vocab_size
    runs, meta = [], []
    for b in sz["sweep_budgets"]:
        prompts = random_prompts(rng, b, sz["latency_prompt"], vocab)
        longest = sz["latency_prompt"][1] + sz["latency_output"]
        for kind, opts in (("dense", dict(kv_cache="dense")),
                           ("paged + gather", dict(kv_cache="paged", attention="gather",
                                                   enable_prefix_caching=False,
                                                   num_pages=b * -(-longest // PAGE_SIZE)))):
            engine = LLMEngine(model, tokenizer, max_num_seqs=b, max_model_len=longest,
                               **opts)
            for p in prompts:
                engine.add_request(p, greedy(sz["latency_output"]))
            runs.append(Run(f"{kind}@{b}", engine))
            meta.append(dict(batch=b, kind=kind))
    run_interleaved(runs)
    return [dict(**m, decode_ms=1e3 * statistics.median(r.decode_times),
                 decode_steps=len(r.decode_times), steps=r.steps,
                 tok_per_s=r.engine.stats()["num_generated_tokens"] / r.busy,
                 running_per_step=r.running)
            for r, m in zip(runs, meta, strict=True)]


def median_rows(rounds: list[list[dict[str, Any]]], keys: tuple[str, ...],
                timed: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per configuration: the first round's counts (checked equal in every round) and the
    median (and spread) over rounds of the timed values."""
    out = []
    for i, first in enumerate(rounds[0]):
        row = {k: v for k, v in first.items() if k not in timed}
        for k in keys:
            if any(rnd[i][k] != first[k] for rnd in rounds):
                raise RuntimeError(f"{first.get('kind')}: {k} differs between rounds")
        for k in timed:
            s = spread([rnd[i][k] for rnd in rounds])
            row[k], row[k + "_spread"] = s["median"], s
        out.append(row)
    return out


def capacity_tables(engine_rows: list[dict[str, Any]], sim_rows: list[dict[str, Any]],
                    latency_rows: list[dict[str, Any]], sz: dict[str, Any], model_name: str,
                    rounds: int) -> list[Table]:
    by = {(r["budget_seqs"], r["kind"]): r for r in engine_rows}
    lat = {(r["batch"], r["kind"]): r for r in latency_rows}
    summary = []
    for b in sz["sweep_budgets"]:
        d, p, s = (by[b, k] for k in CAPACITY_CONFIGS)
        ld, lg = lat[b, "dense"], lat[b, "paged + gather"]
        summary.append([b, d["budget_mib"], d["max_running"], p["max_running"],
                        s["max_running"], p["max_running"] / d["max_running"],
                        s["max_running"] / d["max_running"], d["peak_tokens_held"],
                        p["peak_tokens_held"], s["peak_tokens_held"],
                        p["tok_per_s"] / d["tok_per_s"], s["tok_per_s"] / d["tok_per_s"],
                        ld["decode_ms"], lg["decode_ms"], lg["decode_ms"] / ld["decode_ms"]])
    t0 = Table(
        f"Paging's gain is capacity, not speed ({model_name}): requests and tokens that fit "
        "in the same KV memory, and the decode-step latency at the same batch",
        ["budget (seqs @ max len)", "KV MiB", "max running: dense", "paged",
         "paged + prefix", "paged / dense", "paged + prefix / dense", "peak tokens held: dense",
         "paged", "paged + prefix", "tok/s paged / dense", "tok/s paged + prefix / dense",
         "decode ms at batch = budget: dense", "paged + gather", "gather / dense"],
        summary,
        ["", ".1f", "", "", "", ".2f", ".2f", "", "", "", ".2f", ".2f", ".1f", ".1f", ".2f"],
        "Capacity columns: table 1 (same KV memory, same requests). Latency columns: table 2 "
        "(same batch, same requests, identical schedules): the paged path with Day 3's "
        "gather is no faster per step; paging pays off by fitting more requests (and, with "
        "prefix sharing, more tokens) in the same memory.",
    )
    rows = []
    for b in sz["sweep_budgets"]:
        for kind in CAPACITY_CONFIGS:
            r = by[b, kind]
            rows.append([b, r["budget_mib"], kind, r["max_num_seqs"], r["max_running"],
                         r["mean_running"], r["peak_tokens_held"],
                         r["peak_tokens_held"] / r["budget_tokens"], r["preemptions"],
                         r["prompt_tokens_computed"], r["tok_per_s"],
                         r["tok_per_s"] / by[b, "dense"]["tok_per_s"], r["seconds"]])
    t1 = Table(
        f"1. Capacity at equal KV memory, {model_name} (max_model_len="
        f"{sz['sweep_max_model_len']}, {sz['sweep_requests']} requests: a "
        f"{sz['sweep_prefix']}-token system prompt + {sz['sweep_suffix'][0]}-"
        f"{sz['sweep_suffix'][1]} random tokens, outputs {sz['sweep_output'][0]}-"
        f"{sz['sweep_output'][1]} tokens, greedy, ignore_eos)",
        ["budget (seqs @ max len)", "KV MiB", "engine", "max_num_seqs", "max running",
         "mean running", "peak tokens held", "held / budget tokens", "preemptions",
         "prompt tokens computed", "output tok/s", "tok/s vs dense", "engine s"],
        rows,
        ["", ".1f", "", "", "", ".1f", "", ".2f", "", "", ".2f", ".2f", ".1f"],
        f"Dense admits floor(budget / (max_model_len x bytes/token)) requests (its "
        f"max_num_seqs); paged gets budget // page bytes pages (page_size={PAGE_SIZE}) and "
        f"max_num_seqs={PAGED_MAX_SEQS}, Day 3's gather attention; prefix sharing: "
        "enable_prefix_caching=True. Tokens held: computed tokens of the running requests "
        "after a step (logical K/V; with prefix sharing, shared pages count once per "
        "request, so it can exceed the budget). All engines were stepped round-robin in one "
        f"loop; tok/s and seconds: each engine's own step time, median of {rounds} round(s).",
    )
    sim = {(r["budget_seqs"], r["kind"]): r for r in sim_rows}
    rows = []
    for b in sz["sim_budgets"]:
        for kind in CAPACITY_CONFIGS:
            r = sim[b, kind]
            rows.append([b, kind, r["max_running"], r["mean_running"], r["peak_tokens_held"],
                         r["peak_tokens_held"] / r["budget_tokens"], r["steps"],
                         sim[b, "dense"]["steps"] / r["steps"], r["preemptions"]])
    t2 = Table(
        f"1b. The same at full size, model-free (the engine's schedulers + BlockManager, "
        f"fake tokens): max_model_len=1024, {sz['sim_requests']} requests, a "
        f"{sz['sim_prefix']}-token system prompt + {sz['sim_suffix'][0]}-"
        f"{sz['sim_suffix'][1]} tokens, outputs {sz['sim_output'][0]}-{sz['sim_output'][1]}",
        ["budget (seqs)", "engine", "max running", "mean running", "peak tokens held",
         "held / budget tokens", "steps", "steps dense / this", "preemptions"],
        rows,
        ["", "", "", ".1f", "", ".2f", "", ".2f", ""],
        "Dense: Day 2's chunked scheduler with budget-many slots; paged: Day 3's scheduler "
        f"over a BlockManager of budget x 1024 / {PAGE_SIZE} pages and {PAGED_MAX_SEQS} "
        "slots. Steps are forwards; a step's cost grows with the number of sequences in it, "
        "so the step ratio is an upper bound on the throughput ratio.",
    )
    rows = []
    for b in sz["sweep_budgets"]:
        d, g = lat[b, "dense"], lat[b, "paged + gather"]
        rows.append([b, d["decode_steps"], d["decode_ms"], g["decode_ms"],
                     g["decode_ms"] / d["decode_ms"], d["tok_per_s"], g["tok_per_s"],
                     "yes" if d["running_per_step"] == g["running_per_step"] else "NO"])
    t3 = Table(
        f"2. Latency at equal batch, {model_name}: dense vs paged + gather, the same "
        f"requests (prompts {sz['latency_prompt'][0]}-{sz['latency_prompt'][1]} tokens, "
        f"{sz['latency_output']} output tokens), max_num_seqs = batch",
        ["batch", "decode steps", "dense decode ms/step", "paged + gather decode ms/step",
         "gather / dense", "dense tok/s", "paged + gather tok/s", "same schedule"],
        rows,
        ["", "", ".1f", ".1f", ".2f", ".1f", ".1f", ""],
        "Decode ms/step: median over steps that compute no prompt token, then median of "
        f"{rounds} round(s); pages never short, prefix caching off, so both engines run the "
        "same steps (checked: requests running per step).",
    )
    return [t0, t1, t2, t3]


# ------------------------------------------------------------------ 3. fragmentation


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
        f"3. Fragmentation, {len(lens)} sequences with log-normal lengths (median "
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


# ------------------------------------------------------------------ 4. shared system prompt


def prefix_sharing(model: Model, tokenizer: Any, sz: dict[str, Any]) -> dict[str, Any]:
    """One round of (4): prefix caching off and on, stepped alternately."""
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
                           attention="gather")
        for p in prompts:
            engine.add_request(p, greedy(sz["prefix_output"]))
        runs.append(Run("on" if caching else "off", engine))
    run_interleaved(runs)
    data = {}
    for run in runs:
        s = run.engine.stats()
        ttft = sorted(run.first_token_at.values())
        data[run.label] = dict(
            ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
            prompt_tokens=sum(map(len, prompts)),
            prompt_tokens_computed=s["num_prompt_tokens_computed"],
            hit_rate=s["prefix_cache_hit_tokens"] / max(1, s["prefix_cache_query_tokens"]),
            seconds=run.busy, steps=run.steps,
        )
    return data


def prefix_table(rounds: list[dict[str, Any]], sz: dict[str, Any]) -> tuple[dict, Table]:
    timed = ("ttft_p50", "ttft_p99", "seconds")
    data: dict[str, Any] = {}
    for label in ("off", "on"):
        d = dict(rounds[0][label])
        for k in timed:
            s = spread([rnd[label][k] for rnd in rounds])
            d[k], d[k + "_spread"] = s["median"], s
        data[label] = d
    rows = [[label, d["ttft_p50"], d["ttft_p99"], d["prompt_tokens"],
             d["prompt_tokens_computed"], d["hit_rate"], d["seconds"]]
            for label, d in data.items()]
    ratio = {k: statistics.median(rnd["off"][k] / rnd["on"][k] for rnd in rounds)
             for k in timed}
    off, on = data["off"], data["on"]
    rows.append(["off/on", ratio["ttft_p50"], ratio["ttft_p99"], None,
                 round(off["prompt_tokens_computed"] / on["prompt_tokens_computed"], 2), None,
                 ratio["seconds"]])
    n = sz["prefix_requests"]
    table = Table(
        f"4. Shared system prompt ({sz['prefix_len']} tokens) x {n} requests "
        f"(suffixes {sz['prefix_suffix'][0]}-{sz['prefix_suffix'][1]} tokens, "
        f"{sz['prefix_output']} output tokens), paged, prefix caching off vs on",
        ["prefix caching", "TTFT p50 (s)", "TTFT p99 (s)", "prompt tokens",
         "prefill tokens computed", "hit rate", "total s"],
        rows,
        ["", ".2f", ".2f", "", "", ".3f", ".1f"],
        "All requests arrive at once; TTFT is on each engine's own clock (sum of its step "
        "times), the two engines being stepped alternately; medians of "
        f"{len(rounds)} round(s), the off/on row the median of per-round ratios. Hit rate = "
        "prefix-cache hit tokens / queried prompt tokens.",
    )
    return data, table


# ------------------------------------------------------------------ 5. cost of the gather


def interleaved(fns: dict[str, Any], rounds: int = 3, repeats: int = 3,
                warmup: int = 1) -> dict[str, dict[str, Any]]:
    """``spread`` over rounds of ``measure`` medians, the configurations alternating per
    round (the median is under "median")."""
    got: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            got[name].append(measure(fns[name], warmup=warmup, repeats=repeats).median)
    return {k: spread(v) for k, v in got.items()}


def gather_cost(sz: dict[str, Any], rounds: int, num_layers: int = 30
                ) -> tuple[list[dict], Table]:
    hq, hkv, hd = SMOLLM_HEADS
    scale = hd**-0.5
    rng = random.Random(5)
    geometry = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=hkv, head_dim=hd)
    data, rows = [], []
    for batch in sz["gather_batches"]:
        for ctx in sz["gather_contexts"]:
            pages_per_seq = -(-ctx // PAGE_SIZE)
            num_pages = batch * pages_per_seq + 16
            space = PagedKVStorage(geometry, num_pages, PAGE_SIZE, False, mx.float32)
            pool = space.pool
            # Fill the pool with data (writes through the pool's own API).
            all_slots = mx.arange(num_pages * PAGE_SIZE, dtype=mx.int32)
            rows_kv = mx.random.normal((num_pages * PAGE_SIZE, hkv, hd))
            pool.write(0, all_slots, rows_kv, rows_kv * 0.5)
            mx.eval(pool.k, pool.v)
            order = list(range(num_pages))
            rng.shuffle(order)  # pages scattered, as after a while of allocation churn
            tables = [order[b * pages_per_seq:(b + 1) * pages_per_seq] for b in range(batch)]
            slot_mapping = [slots_for(t, ctx - 1, ctx, PAGE_SIZE)[0] for t in tables]
            step = StepBatch(  # a decode step: one token per sequence, at position ctx - 1
                chunks=[], token_ids=mx.zeros((batch,), mx.int32),
                positions=mx.full((batch,), ctx - 1, mx.int32),
                query_start_loc=list(range(batch + 1)), context_lens=[ctx] * batch,
                logit_rows=mx.arange(batch, dtype=mx.int32), sampling=[], drafts=[],
                decode_rows=batch,
                kv=PagedLayout(tables, mx.array(slot_mapping, dtype=mx.int32),
                               block_table(tables, pages_per_seq),
                               mx.array([ctx] * batch, dtype=mx.int32),
                               mx.arange(batch + 1, dtype=mx.int32)))
            gather = GatherAttention(space)
            gather.begin_step(step)  # once per step, shared by the layers: not timed
            q = mx.random.normal((batch, hq, hd))
            k_new = mx.random.normal((batch, hkv, hd))
            v_new = mx.random.normal((batch, hkv, hd))
            slot_arrays = gather.context_slots
            dense_k = [pool.gather(0, s)[0] for s in slot_arrays]
            dense_v = [pool.gather(0, s)[1] for s in slot_arrays]
            mx.eval(q, k_new, v_new, dense_k, dense_v)

            def paged_step(gather=gather, q=q, k_new=k_new, v_new=v_new):
                return gather.attend(0, q, k_new, v_new, scale)

            def dense_step(q=q, dk=dense_k, dv=dense_v, ctx=ctx):
                outs = [causal_attention(q[b:b + 1], dk[b], dv[b], scale, ctx - 1)
                        for b in range(len(dk))]
                return outs[0] if len(outs) == 1 else mx.concatenate(outs)

            def gather_only(pool=pool, slots=slot_arrays):
                return [pool.gather(0, s) for s in slots]

            sp = interleaved({"paged": paged_step, "dense": dense_step, "gather": gather_only},
                             rounds=max(rounds, 3), repeats=5)
            t = {k: v["median"] for k, v in sp.items()}
            copied = batch * ctx * hkv * hd * 4 * 2
            d = dict(batch=batch, context=ctx, paged_s=t["paged"], dense_s=t["dense"],
                     gather_s=t["gather"], share=(t["paged"] - t["dense"]) / t["paged"],
                     gather_alone_share=t["gather"] / t["paged"],
                     bytes_per_layer=copied, bytes_per_step=copied * num_layers,
                     gather_gb_s=copied / t["gather"] / 1e9, spread=sp)
            data.append(d)
            rows.append([batch, ctx, d["paged_s"] * 1e3, d["dense_s"] * 1e3, d["gather_s"] * 1e3,
                         d["share"], d["gather_alone_share"], d["paged_s"] / d["dense_s"],
                         copied / 2**20,
                         copied * num_layers / 2**20, d["gather_gb_s"]])
            del pool, space, gather
    table = Table(
        "5. One decode step's attention, one layer, SmolLM2 heads (9 q / 3 kv / 64, float32): "
        "GatherAttention.attend (page write + per-sequence gather + causal_attention) vs "
        "causal_attention on pre-gathered contiguous K/V",
        ["batch", "context", "paged ms", "dense ms", "gather alone ms",
         "gather share (paged-dense)/paged", "gather alone / paged", "paged/dense",
         "MiB copied / layer", f"MiB copied / step ({num_layers} layers)",
         "gather GB/s"],
        rows,
        ["", "", ".3f", ".3f", ".3f", ".2f", ".2f", ".2f", ".2f", ".0f", ".2f"],
        "Gather share = (paged - dense) / paged, i.e. write + gather; 'gather alone' times "
        "the per-sequence gathers by themselves (begin_step's slot lists, built once per "
        "step for all layers, are not timed). Bytes copied = batch x context x kv_heads x "
        "head_dim x 4 B x 2 (K and V), per layer; a full SmolLM2 decode step copies 30x "
        f"that. Median over {max(rounds, 3)} interleaved rounds of medians of 5 calls.",
    )
    return data, table


# ------------------------------------------------------------------ 6. cost of the page write


def write_cost(sz: dict[str, Any], rounds: int) -> tuple[list[dict], Table]:
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
            t_in = interleaved({"w": write}, rounds=max(rounds, 3), repeats=5)["w"]
            in_place = buffer_address(pool.k[0]) == before
            big = pool_slots >= 131072
            # A whole-pool copy per call: one timed call is plenty for the big pools.
            t_view = interleaved({"w": write_with_view}, rounds=1 if big else 2,
                                 repeats=1 if big else 3, warmup=0 if big else 1)["w"]
            held.clear()
            pool_mib = 2 * pool.k[0].nbytes / 2**20
            d = dict(pool_slots=pool_slots, rows=n, pool_mib=pool_mib,
                     in_place_s=t_in["median"], same_buffer=in_place,
                     with_view_s=t_view["median"], spread=t_in)
            data.append(d)
            rows.append([pool_slots, pool_mib, n, d["in_place_s"] * 1e6,
                         "yes" if in_place else "NO", d["with_view_s"] * 1e6,
                         d["with_view_s"] / d["in_place_s"]])
        del pool
    table = Table(
        "6. PagePool.write (MLX indexed assignment, K and V, one layer) vs pool size",
        ["pool slots", "pool MiB (K+V)", "new rows", "write µs", "same buffer after",
         "write µs, stray view alive", "view/no view"],
        rows,
        ["", ".1f", "", ".1f", "", ".0f", ".0f"],
        "Same buffer: the pool's data pointer is unchanged after the writes (MLX donated the "
        "buffer to the scatter). With a stray view (an evaluated reshape of the pool) alive, "
        "MLX must keep the old buffer, so every write copies the whole pool. Write µs: median "
        f"over {max(rounds, 3)} rounds of medians of 5 calls.",
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
    colors = {"dense": "tab:red", "paged": "tab:blue", "paged + prefix sharing": "tab:green"}
    for rows, style, tag in ((sweep, "-o", "engine"), (sim, "--s", "model-free, full size")):
        for kind, color in colors.items():
            pts = [(r["budget_seqs"], r["max_running"]) for r in rows if r["kind"] == kind]
            ax.plot(*zip(*pts, strict=True), style, color=color, label=f"{kind} ({tag})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget (sequences at max_model_len)")
    ax.set_ylabel("max requests running at once")
    ax.set_title("Capacity: requests that fit in the same KV memory")
    ax.legend(fontsize=7)

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
    ax.set_title("Latency: Day 3 gather's share of a decode step's attention (one layer)")
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
    args = bench_parser(__doc__).parse_args()
    sz = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    model, tokenizer, model_name = load_model(args.quick, vocab_size=512)
    warm_up(model, tokenizer)
    t = lap(timings, "load+warmup", t_start)

    frag_data, frag_table = fragmentation(sz)
    sim_rows = capacity_simulated(sz)
    t = lap(timings, "fragmentation+simulation", t)
    write_data, write_table = write_cost(sz, args.rounds)
    t = lap(timings, "page write", t)
    gather_data, gather_table = gather_cost(sz, args.rounds)
    t = lap(timings, "gather", t)
    cap_rounds, lat_rounds, prefix_rounds = [], [], []
    for r in range(args.rounds):
        parts = [("capacity", lambda: cap_rounds.append(capacity_engines(model, tokenizer, sz))),
                 ("latency", lambda: lat_rounds.append(latency_engines(model, tokenizer, sz))),
                 ("prefix", lambda: prefix_rounds.append(prefix_sharing(model, tokenizer, sz)))]
        for _, fn in parts if r % 2 == 0 else parts[::-1]:
            fn()
        t = lap(timings, f"engines, round {r + 1}/{args.rounds}", t)
    cap_rows = median_rows(cap_rounds, ("max_running", "peak_tokens_held", "preemptions",
                                        "prompt_tokens_computed", "generated"),
                           ("seconds", "tok_per_s"))
    lat_rows = median_rows(lat_rounds, ("steps", "decode_steps"), ("decode_ms", "tok_per_s"))
    prefix_data, prefix_tab = prefix_table(prefix_rounds, sz)

    tables = [*capacity_tables(cap_rows, sim_rows, lat_rows, sz, model_name, args.rounds),
              frag_table, prefix_tab, gather_table, write_table]
    timings["total"] = time.perf_counter() - t_start
    data = dict(model=model_name, sizes=sz, page_size=PAGE_SIZE,
                kv_bytes_per_token=kv_bytes_per_token(model.config, model.dtype),
                capacity=cap_rows, capacity_simulated=sim_rows, latency=lat_rows,
                fragmentation=frag_data, prefix_caching=prefix_data, gather=gather_data,
                page_write=write_data, seconds=timings)
    fig = make_figure(cap_rows, sim_rows, frag_data, gather_data, write_data)
    save_results(NAME + ("_quick" if args.quick else ""), data, tables, fig, rounds=args.rounds)
    print(f"total {timings['total']:.0f} s")


if __name__ == "__main__":
    main()
