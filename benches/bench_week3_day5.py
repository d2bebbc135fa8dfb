"""Week 3, Day 5: the tiled (FlashAttention) prefill schedule, and the whole course's
progression of engine configurations on one workload, next to mlx-lm.

Three measurements; in each, the configurations compared run in the same process,
interleaved, and ratios are taken within the run.

1. **Prefill attention, one layer** (SmolLM2's heads: 9 query / 3 KV heads, head_dim 64,
   float32, page_size 16, pages of the sequence in shuffled pool order). A query of ``L``
   tokens at the end of a context of ``S`` tokens (query row ``i`` sits at position
   ``S - L + i`` and sees keys ``0 .. S - L + i``), three ways:

   - ``kernel``: ``paged_attention`` (the extension op; multi-token rows run the tiled
     schedule, 16 query rows per tile sharing every page they read; its C++ threads use
     both cores) — also with ``set_num_threads(1)`` (``kernel 1T``), since MLX's own CPU
     ops and OpenBLAS run on one thread here;
   - ``reference``: ``paged_attention_reference`` (the MLX-op page walk, one page column
     per iteration, every query row gathering its own copy of the page); skipped where
     ``L x S`` exceeds ``ref_max_units`` (it is O(L x S) gathered bytes);
   - ``mx.fast``: ``mx.fast.scaled_dot_product_attention`` on dense, contiguous K/V
     (``[1, H, S, D]``, gathered from the pages before timing), with ``mask="causal"`` when
     ``L == S`` and otherwise an explicit boolean ``[L, S]`` mask ``key <= S - L + row``
     (built and evaluated before timing).

   Each point: one warmup call each, then ``attn_rounds`` rounds (``ref_rounds`` for the
   reference) timing every implementation once, the order rotating per round; the median
   is reported, and ``kernel / mx.fast``. Points with ``L x S > attn_max_units`` are not
   run (full run: L = 1024 stops at S = 2048). All outputs are checked against ``mx.fast``
   (max abs error).

2. **TTFT of one long prompt** (random token ids, ``max_tokens=1``, engine defaults:
   paged KV, chunked prefill with the default budget of 512 tokens per step, prefix caching
   on but nothing to hit). Day 4's engine ran decode rows on the kernel's vector schedule
   but sent multi-token rows through the MLX page walk; Day 4 is emulated with
   ``attention="reference"`` (the page walk for every row: during a prefill there are only
   multi-token rows, so this is exactly Day 4's prefill path), Day 5 with
   ``attention="kernel"`` (the tiled schedule for the prefill chunks). TTFT = wall time
   from the first ``engine.step()`` to the step that returns the first token (the request is
   added just before). The two alternate, in alternating order, for ``ttft_rounds`` rounds
   (median); reference runs are skipped above ``ttft_ref_max`` tokens (too slow here). Full
   run: 1,024 and 2,048 tokens, Day 4 at 1,024 only (about a minute there, and it grows with
   the square of the prompt); 4,096 was not affordable in the time budget.

3. **The progression on one workload**: 16 requests arriving at t=0 (prompts of 64-256
   random token ids, the first 128 of them a shared system prefix in half of the requests;
   outputs 16-48 tokens, fixed by ``max_tokens`` with ``ignore_eos``, greedy), through six
   engine configurations, all with ``max_num_seqs=8`` and ``max_model_len=1024``. (Shrunk
   from 24 requests, prompts 64-512 and outputs 16-96 to keep the whole script near ten
   minutes on a shared 2-core CPU, where one decode step of SmolLM2 takes 0.1-0.2 s.)

   ===============  ==========================================================================
   static           scheduler="static", kv_cache="dense", enable_chunked_prefill=False,
                    max_num_batched_tokens=4096 (a budget that never binds)
   continuous       scheduler="continuous", kv_cache="dense", no chunking, budget 4096
   chunked          kv_cache="dense", chunked prefill, default budget (512)
   paged+gather     kv_cache="paged", attention="gather" (Day 3: gathers dense K/V per step)
   direct paged     kv_cache="paged", attention="reference" (Day 4's MLX page walk, all rows)
   final            the defaults: paged, attention="kernel", chunked, prefix caching
   ===============  ==========================================================================

   The paged configurations keep the other defaults (chunked prefill, budget 512, prefix
   caching on) and get ``num_pages = max_num_seqs x pages of the longest request``: what a
   dense reservation for 8 such requests would hold. The engines are stepped round-robin in
   one loop, each on its own clock (the sum of its own step times), so a noisy neighbour
   hurts them alike; all times below are on that clock, with all requests arriving at 0.

   Reported per configuration: output tok/s (generated tokens / clock at the last token);
   TTFT p50/p99; inter-token latency (ITL, gaps between consecutive tokens of a request)
   p50/p99; peak KV bytes allocated (``stats()["kv_cache_bytes"]``: dense buffers as grown,
   or the paged pool) and peak live KV bytes (dense: stored tokens x bytes/token; paged:
   referenced pages x page bytes); bytes copied per step by attention (gather: the context
   rows of every scheduled sequence, all layers, K and V; dense: the copies made when a
   per-request buffer grows by 256 rows; direct paged and kernel: none — the kernel's own
   ``pool_copies()`` counter is checked); whether each request's tokens equal the first
   configuration's; and where a step's time goes (scheduler, block-table metadata, batch
   layout, graph construction, MLX evaluation of the forward, sampling and bookkeeping).

   Then the same requests through mlx-lm (0.32.x) with the same float32 arrays
   (``mlx_lm.models.llama.Model`` built from our ``ModelConfig``, loaded with our model's
   parameters): ``BatchGenerator`` driven by exactly ``batch_generate``'s loop
   (``while responses := gen.next_generated()``) with ``completion_batch_size=8``,
   ``prefill_batch_size=8``, its default ``prefill_step_size=2048`` (so every prompt is
   prefilled whole, left-padded in batches of up to 8), greedy, no stop tokens (to match
   ``ignore_eos``), stepped in the same round-robin loop with timestamps per token. mlx-lm
   pipelines: ``next_generated()`` returns after queueing the following step with
   ``mx.async_eval``, so each of its steps here ends with ``mx.synchronize(gen.stream)``;
   otherwise its queued compute would run during (and be charged to) the other engines'
   steps. That costs it the overlap of its Python work with compute, a few ms per step.
   Then one plain ``batch_generate`` call, timed wall-clock, alone, after the loop.

   Finally, every second step of the final configuration is followed at once by the same
   step's matmuls alone (all linear layers at the step's token count and the tied
   vocabulary projection at one row per sampled sequence): how much of the forward is GEMM.

OpenBLAS runs with one thread (``tiny_llm``'s default unless ``OPENBLAS_NUM_THREADS`` is
set): on a shared 2-core machine its spinning threads make runs 5-10x slower and noisy. The
script loads a private copy of the built extension (its sha256 is recorded) so that a
rebuild of ``src/extensions`` during the run cannot crash it.

    python benches/bench_week3_day5.py           # SmolLM2-135M, 5-10 minutes on 2 cores
    python benches/bench_week3_day5.py --quick   # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tiny_llm
from tiny_llm.day3_paged_kv import blocks_needed, kv_bytes_per_token
from tiny_llm.day4_paged_attention import (
    paged_attention,
    paged_attention_reference,
)
from tiny_llm.engine import LLMEngine
from tiny_llm.extension import extension
from tiny_llm.model import Model
from tiny_llm.tokenizer import IncrementalDetokenizer

import mlx.core as mx
import numpy as np
from common import (
    Table,
    greedy,
    lap,
    load_model,
    mlx_lm_model,
    percentile,
    save_results,
)
from mlx.utils import tree_flatten

NAME = "bench_week3_day5"
PAGE_SIZE = 16
HEADS = (9, 3, 64)  # SmolLM2: query heads, KV heads, head_dim
MAX_NUM_SEQS = 8
NO_CHUNK_BUDGET = 4096

FULL = dict(
    attn_queries=[64, 256, 1024],
    attn_contexts=[256, 1024, 2048, 4096, 8192],
    attn_max_units=1024 * 2048,  # skip kernel/mx.fast points with L x S above this
    ref_max_units=1024 * 1024,  # skip the reference page walk above this L x S
    attn_rounds=3,
    ref_rounds=1,  # the page walk is 4-10x slower: one timed call after the warmup
    ttft_prompts=[1024, 2048],
    ttft_ref_max=1024,
    ttft_rounds=1,
    requests=16,
    prompt=(64, 256),
    prefix=128,
    output=(16, 48),
    max_model_len=1024,
    plain_batch_generate=True,
)
QUICK = dict(
    attn_queries=[16, 64],
    attn_contexts=[64, 256],
    attn_max_units=64 * 256,
    ref_max_units=64 * 256,
    attn_rounds=2,
    ref_rounds=1,
    ttft_prompts=[128, 256],
    ttft_ref_max=256,
    ttft_rounds=1,
    requests=8,
    prompt=(16, 64),
    prefix=32,
    output=(4, 12),
    max_model_len=256,
    plain_batch_generate=True,
)

CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("static", dict(scheduler="static", kv_cache="dense", enable_chunked_prefill=False,
                    max_num_batched_tokens=NO_CHUNK_BUDGET)),
    ("continuous", dict(scheduler="continuous", kv_cache="dense", enable_chunked_prefill=False,
                        max_num_batched_tokens=NO_CHUNK_BUDGET)),
    ("chunked", dict(kv_cache="dense", enable_chunked_prefill=True)),
    ("paged+gather", dict(kv_cache="paged", attention="gather")),
    ("direct paged", dict(kv_cache="paged", attention="reference")),
    ("final", dict()),
]


# ------------------------------------------------------------------ setup


def pin_extension() -> dict[str, Any]:
    """Import a private copy of the built extension as ``tiny_llm._native._ext``.

    Another process rebuilding ``src/extensions`` rewrites the ``.so`` in place, and a
    process that has it mapped then dies of SIGBUS. ``extension()`` imports the module by
    name, so registering the copy first makes every user in this process take it."""
    name = "tiny_llm._native._ext"
    if name in sys.modules:
        raise RuntimeError("the extension was imported before pin_extension()")
    native = Path(tiny_llm.__file__).parent / "_native"
    for attempt in range(10):
        built = sorted(native.glob("_ext*.so"))
        if not built:
            extension()  # raises the error that says how to build it
        data = built[0].read_bytes()
        module = _load_copy(name, built[0].name, data) if data == built[0].read_bytes() else None
        if module is not None:
            sys.modules[name] = module
            return dict(path=str(built[0]), sha256=hashlib.sha256(data).hexdigest()[:16],
                        mtime=time.strftime("%Y-%m-%d %H:%M:%S",
                                            time.gmtime(built[0].stat().st_mtime)))
        time.sleep(1 + attempt)  # mid-rebuild: try again
    raise RuntimeError(f"could not load a consistent copy of {native}/_ext*.so")


def _load_copy(name: str, filename: str, data: bytes) -> Any:
    folder = Path(tempfile.mkdtemp(prefix="tiny_llm_ext_"))
    try:
        copy = folder / filename
        copy.write_bytes(data)
        spec = importlib.util.spec_from_file_location(name, copy)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a loaded copy stays mapped


class StubTokenizer:
    """What the engine and mlx-lm need from a tokenizer when prompts are token ids."""

    eos_token_ids: set[int] = set()

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(lambda ids: "")

    def decode(self, ids: list[int]) -> str:
        return ""


# ------------------------------------------------------------------ 1. prefill attention


def prefill_attention(sz: dict[str, Any]) -> tuple[list[dict[str, Any]], Table]:
    hq, hkv, hd = HEADS
    scale = hd**-0.5
    ext = extension()
    rng = random.Random(1)
    points = [(q, s) for q in sz["attn_queries"] for s in sz["attn_contexts"]
              if q <= s and q * s <= sz["attn_max_units"]]
    data, rows = [], []
    for L, S in points:
        pages = S // PAGE_SIZE
        num_pages = pages + 16
        mx.random.seed(L + S)
        k_pages = mx.random.normal((num_pages, PAGE_SIZE, hkv, hd))
        v_pages = mx.random.normal((num_pages, PAGE_SIZE, hkv, hd))
        order = list(range(num_pages))
        rng.shuffle(order)  # the sequence's pages scattered over the pool
        table = order[:pages]
        block_table = mx.array([table], dtype=mx.int32)
        context_lens = mx.array([S], dtype=mx.int32)
        qsl = mx.array([0, L], dtype=mx.int32)
        q = mx.random.normal((L, hq, hd))
        idx = mx.array(table, dtype=mx.int32)
        k_dense = k_pages[idx].reshape(S, hkv, hd).transpose(1, 0, 2)[None]  # [1, Hkv, S, D]
        v_dense = v_pages[idx].reshape(S, hkv, hd).transpose(1, 0, 2)[None]
        k_dense, v_dense = mx.contiguous(k_dense), mx.contiguous(v_dense)
        q_dense = mx.contiguous(q.transpose(1, 0, 2)[None])  # [1, Hq, L, D]
        if L == S:
            mask: Any = "causal"
        else:
            mask = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]
        mx.eval(k_pages, v_pages, q, k_dense, v_dense, q_dense, mask)

        def kernel(q=q, kp=k_pages, vp=v_pages, bt=block_table, cl=context_lens, qsl=qsl):
            return paged_attention(q, kp, vp, bt, cl, qsl, scale, validate=False)

        def reference(q=q, kp=k_pages, vp=v_pages, bt=block_table, cl=context_lens, qsl=qsl):
            return paged_attention_reference(q, kp, vp, bt, cl, qsl, scale)

        def fast(q=q_dense, k=k_dense, v=v_dense, mask=mask):
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            return out[0].transpose(1, 0, 2)

        impls: dict[str, tuple[Any, int]] = {"kernel": (kernel, 0), "kernel 1T": (kernel, 1),
                                             "mx.fast": (fast, 0)}
        if L * S <= sz["ref_max_units"]:
            impls["reference"] = (reference, 0)
        oracle = fast()
        errors = {}
        for name, (fn, threads) in impls.items():
            ext.set_num_threads(threads)
            errors[name] = mx.abs(fn() - oracle).max().item()  # also the warmup call
        times: dict[str, list[float]] = {name: [] for name in impls}
        names = list(impls)
        for r in range(sz["attn_rounds"]):
            for name in names[r % len(names):] + names[: r % len(names)]:
                if name == "reference" and r >= sz["ref_rounds"]:
                    continue
                fn, threads = impls[name]
                ext.set_num_threads(threads)
                start = time.perf_counter()
                mx.eval(fn())
                times[name].append(time.perf_counter() - start)
        ext.set_num_threads(0)
        t = {name: statistics.median(v) for name, v in times.items()}
        d = dict(query_len=L, context=S, times=times, median_s=t, max_abs_err=errors)
        data.append(d)
        ref = t.get("reference")
        rows.append([L, S, t["kernel"] * 1e3, t["kernel 1T"] * 1e3, t["mx.fast"] * 1e3,
                     None if ref is None else ref * 1e3, t["kernel"] / t["mx.fast"],
                     t["kernel 1T"] / t["mx.fast"], None if ref is None else ref / t["kernel"],
                     max(errors.values())])
        print(f"  attention L={L} S={S}: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in t.items()), flush=True)
        del k_pages, v_pages, k_dense, v_dense, mask
    skipped = [f"{q}x{s}" for q in sz["attn_queries"] for s in sz["attn_contexts"]
               if q <= s and q * s > sz["attn_max_units"]]
    table = Table(
        f"1. Prefill attention, one layer ({hq} q / {hkv} kv heads, head_dim {hd}, float32, "
        f"page_size {PAGE_SIZE}, shuffled pages): a query of L tokens at the end of a "
        f"context of S tokens",
        ["L", "S", "kernel ms", "kernel 1T ms", "mx.fast ms", "reference ms",
         "kernel / mx.fast", "kernel 1T / mx.fast", "reference / kernel", "max abs err"],
        rows,
        ["", "", ".2f", ".2f", ".2f", ".1f", ".2f", ".2f", ".1f", ".1e"],
        "kernel: paged_attention (tiled schedule, C++ threads on both cores); kernel 1T: the "
        "same with set_num_threads(1); mx.fast: mx.fast.scaled_dot_product_attention on "
        "contiguous dense K/V (mask='causal' when L == S, else an explicit boolean [L, S] "
        "mask key <= S - L + row; OpenBLAS and MLX on one thread); reference: the MLX-op page "
        f"walk, run only where L x S <= {sz['ref_max_units']} ('–' elsewhere). Median of "
        f"{sz['attn_rounds']} interleaved rounds ({sz['ref_rounds']} for the reference), "
        "each after one warmup call. Max abs err: largest of kernel/reference "
        "vs mx.fast."
        + (f" Points skipped (too slow for the time budget): {', '.join(skipped)}."
           if skipped else ""),
    )
    return data, table


# ------------------------------------------------------------------ 2. TTFT, long prompts


def ttft_once(model: Model, tokenizer: Any, prompt: list[int], attention: str) -> dict:
    engine = LLMEngine(model, tokenizer, attention=attention, max_model_len=len(prompt) + 64,
                       num_pages=blocks_needed(len(prompt) + 64, PAGE_SIZE) + 4)
    engine.add_request(prompt, greedy(1))
    start = time.perf_counter()
    token = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            token = out.outputs[0].token_ids[0]
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, steps=engine.stats()["num_steps"], token=token)


def ttft_long(model: Model, tokenizer: Any, sz: dict[str, Any]) -> tuple[list[dict], Table]:
    rng = random.Random(2)
    vocab = model.config.vocab_size
    data, rows = [], []
    for n in sz["ttft_prompts"]:
        prompt = [rng.randrange(vocab) for _ in range(n)]
        attentions = ["reference", "kernel"] if n <= sz["ttft_ref_max"] else ["kernel"]
        runs: dict[str, list[dict]] = {a: [] for a in attentions}
        for r in range(sz["ttft_rounds"]):
            for att in attentions if r % 2 == 0 else attentions[::-1]:
                runs[att].append(ttft_once(model, tokenizer, prompt, att))
                print(f"  TTFT {n} tokens, {att}: {runs[att][-1]['seconds']:.1f} s", flush=True)
        t = {a: statistics.median(x["seconds"] for x in v) for a, v in runs.items()}
        same = len({x["token"] for v in runs.values() for x in v}) == 1
        d = dict(prompt_tokens=n, runs=runs, median_s=t, same_first_token=same)
        data.append(d)
        ref = t.get("reference")
        rows.append([n, runs["kernel"][0]["steps"], None if ref is None else ref, t["kernel"],
                     None if ref is None else ref / t["kernel"], "yes" if same else "NO"])
    table = Table(
        "2. TTFT of one long prompt, Day 4 (attention='reference': the MLX page walk for "
        "prefill rows) vs Day 5 (attention='kernel': tiled schedule), chunked prefill at the "
        "default budget (512 tokens per step)",
        ["prompt tokens", "steps", "Day 4 TTFT s", "Day 5 TTFT s", "Day 4 / Day 5",
         "same first token"],
        rows,
        ["", "", ".2f", ".2f", ".2f", ""],
        "One request, random token ids, max_tokens=1, otherwise engine defaults (paged, "
        "prefix caching on, nothing to hit). TTFT: wall time from the first step to the "
        f"token. {sz['ttft_rounds']} round(s), the two alternating; Day 4 is not run above "
        f"{sz['ttft_ref_max']} tokens ('–'): its page walk gathers a page copy per query row, "
        "O(prompt^2) bytes, minutes per prompt here.",
    )
    return data, table


# ------------------------------------------------------------------ 3. the progression


def workload(sz: dict[str, Any], vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    system = [rng.randrange(vocab) for _ in range(sz["prefix"])]
    prompts, outputs = [], []
    for i in range(sz["requests"]):
        n = rng.randint(*sz["prompt"])
        head = system if i % 2 == 0 else []
        prompts.append(head + [rng.randrange(vocab) for _ in range(n - len(head))])
        outputs.append(rng.randint(*sz["output"]))
    return prompts, outputs


class TimedModel:
    """The engine's model, timing graph construction and evaluation separately. The
    logits depend on every layer's K/V writes, so evaluating them here runs the whole
    forward; the engine's own ``mx.eval`` afterwards finds nothing left to do."""

    def __init__(self, model: Model, times: dict[str, float]):
        self._model, self._times = model, times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any) -> mx.array:
        t0 = time.perf_counter()
        logits = self._model(*args)
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        self._times["graph"] += t1 - t0
        self._times["eval"] += t2 - t1
        return logits


class EngineRun:
    """One engine of the round-robin loop: its own clock and per-step records."""

    def __init__(self, label: str, engine: LLMEngine, prompts: list[list[int]],
                 outputs: list[int]):
        self.label, self.engine = label, engine
        self.rids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, outputs,
                                                                      strict=True)]
        self.clock = 0.0
        self.token_times: dict[str, list[float]] = {r: [] for r in self.rids}
        self.tokens: dict[str, list[int]] = {r: [] for r in self.rids}
        self.steps: list[dict[str, Any]] = []
        self.bpt = kv_bytes_per_token(engine.model.config, engine.model.dtype)
        self.peak_alloc = self.peak_live = 0
        self._t = dict.fromkeys(("schedule", "metadata", "forward", "graph", "eval"), 0.0)
        self._copied = 0
        self._step_tokens = 0
        self._decode_only = True
        self._instrument()

    def _instrument(self) -> None:
        engine, t = self.engine, self._t
        schedule, batch, forward = engine.scheduler.schedule, engine.kv.batch, engine._forward

        def timed_schedule():
            start = time.perf_counter()
            chunks = schedule()
            t["schedule"] += time.perf_counter() - start
            self._step_tokens = sum(c.num_tokens for c in chunks)
            self._decode_only = all(c.request.num_computed_tokens >= len(c.request.prompt_token_ids)
                                    for c in chunks)
            return chunks

        def timed_batch(chunks, query_start_loc):
            start = time.perf_counter()
            kv = batch(chunks, query_start_loc)
            t["metadata"] += time.perf_counter() - start
            if hasattr(kv, "context_slots"):  # Day 3's gather: context rows, all layers, K+V
                self._copied += sum(int(s.shape[0]) for s in kv.context_slots) * self.bpt
            return kv

        def timed_forward(chunks):
            start = time.perf_counter()
            result = forward(chunks)
            t["forward"] += time.perf_counter() - start
            return result

        engine.scheduler.schedule = timed_schedule
        engine.kv.batch = timed_batch
        engine._forward = timed_forward
        engine.model = TimedModel(engine.model, t)

    def dense_sizes(self) -> list[int]:
        return [c.nbytes() for c in self.engine.kv.caches] if self.dense else []

    @property
    def dense(self) -> bool:
        return self.engine.config.kv_cache == "dense"

    def step(self) -> None:
        for k in self._t:
            self._t[k] = 0.0
        self._copied = 0
        before = self.dense_sizes()
        start = time.perf_counter()
        outputs = self.engine.step()
        dt = time.perf_counter() - start
        self.clock += dt
        for out in outputs:
            if out.new_token_ids:
                self.token_times[out.request_id] += [self.clock] * len(out.new_token_ids)
                self.tokens[out.request_id] += out.new_token_ids
        # dense: a buffer that grew was copied (concatenate) at its old size
        self._copied += sum(b for b, a in zip(before, self.dense_sizes(), strict=True)
                            if b and a > b)
        kv, stats = self.engine.kv, self.engine.stats()
        if self.dense:
            live = sum(c.length for c in kv.caches) * self.bpt
        else:
            used = stats["num_pages"] - stats["num_free_pages"]
            live = used * self.bpt * stats["page_size"]
        self.peak_alloc = max(self.peak_alloc, stats["kv_cache_bytes"])
        self.peak_live = max(self.peak_live, live)
        t = self._t
        self.steps.append(dict(
            seconds=dt, tokens=self._step_tokens, decode_only=self._decode_only,
            schedule=t["schedule"], metadata=t["metadata"], graph=t["graph"], eval=t["eval"],
            layout=t["forward"] - t["metadata"] - t["graph"] - t["eval"],
            sample_update=dt - t["schedule"] - t["forward"], copied=self._copied,
            sampled=sum(1 for o in outputs if o.new_token_ids),
        ))

    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()


class MlxLmRun:
    """mlx-lm's BatchGenerator, stepped by batch_generate's own loop, on its own clock."""

    def __init__(self, lm_model: Any, prompts: list[list[int]], outputs: list[int]):
        from mlx_lm.generate import BatchGenerator

        self.label = "mlx-lm"
        self.gen = BatchGenerator(lm_model, stop_tokens=None,
                                  completion_batch_size=MAX_NUM_SEQS,
                                  prefill_batch_size=MAX_NUM_SEQS)
        self.uids = self.gen.insert(prompts, outputs)
        self.clock = 0.0
        self.token_times: dict[int, list[float]] = {u: [] for u in self.uids}
        self.tokens: dict[int, list[int]] = {u: [] for u in self.uids}
        self.steps: list[dict[str, Any]] = []
        self.finished: set[int] = set()
        self.peak_alloc = 0
        self._done = False

    def step(self) -> None:
        start = time.perf_counter()
        responses = self.gen.next_generated()
        # next_generated() returns after async_eval-ing the following step (pipelining):
        # finish that work here, on mlx-lm's own clock, not during the other engines' steps.
        mx.synchronize(self.gen.stream)
        dt = time.perf_counter() - start
        self.clock += dt
        self.steps.append(dict(seconds=dt, tokens=len(responses)))
        if not responses:
            self._done = True
            self.gen.close()
            return
        for r in responses:
            if r.finish_reason != "stop":
                self.token_times[r.uid].append(self.clock)
                self.tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                self.finished.add(r.uid)
        self.peak_alloc = max(self.peak_alloc, self.gen.prompt_cache_nbytes)
        if len(self.finished) == len(self.uids):  # batch_generate's next call returns []
            self._done = True
            self.gen.close()

    def done(self) -> bool:
        return self._done


class GemmProbe:
    """The model's matmuls alone: every linear layer at ``tokens`` rows and the (tied)
    vocabulary projection at ``logit_rows`` rows, on fresh random inputs."""

    def __init__(self, model: Model):
        import mlx.nn as nn

        self.weights = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
        self.lm_head = model.model.embed_tokens.weight if model.config.tie_word_embeddings \
            else None

    def time(self, tokens: int, logit_rows: int) -> float:
        xs = {d: mx.random.normal((tokens, d)) for d in {w.shape[1] for w in self.weights}}
        hidden = self.weights[0].shape[1] if self.lm_head is None else self.lm_head.shape[1]
        x_lm = mx.random.normal((logit_rows, hidden))
        mx.eval(xs, x_lm)
        start = time.perf_counter()
        outs = [xs[w.shape[1]] @ w.T for w in self.weights]
        if self.lm_head is not None:
            outs.append(x_lm @ self.lm_head.T)
        mx.eval(outs)
        return time.perf_counter() - start


def gemm_share(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind, decode in (("decode", True), ("prefill", False)):
        sel = [s for s in steps if "gemm_alone" in s and s["decode_only"] == decode]
        if sel:
            out[kind] = dict(n=len(sel), tokens=statistics.fmean(s["tokens"] for s in sel),
                             step=statistics.fmean(s["seconds"] for s in sel),
                             eval=statistics.fmean(s["eval"] for s in sel),
                             gemm=statistics.fmean(s["gemm_alone"] for s in sel))
    return out


def summarize(run: Any, ids: list[Any]) -> dict[str, Any]:
    ttft = [run.token_times[i][0] for i in ids]
    gaps = [float(g) for i in ids for g in np.diff(run.token_times[i])]
    generated = sum(len(run.token_times[i]) for i in ids)
    last = max(run.token_times[i][-1] for i in ids)
    return dict(tok_per_s=generated / last, seconds=last, generated=generated,
                ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
                itl_p50=percentile(gaps, 50), itl_p99=percentile(gaps, 99), steps=len(run.steps))


def breakdown(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    keys = ("seconds", "schedule", "metadata", "layout", "graph", "eval", "sample_update")
    out = {}
    for kind, sel in (("decode", [s for s in steps if s["decode_only"]]),
                      ("prefill", [s for s in steps if not s["decode_only"]])):
        if sel:
            out[kind] = {k: statistics.fmean(s[k] for s in sel) for k in keys}
            out[kind]["n"] = len(sel)
            out[kind]["tokens"] = statistics.fmean(s["tokens"] for s in sel)
    return out


def progression(model: Model, tokenizer: Any, sz: dict[str, Any]
                ) -> tuple[dict[str, Any], list[Table]]:
    from mlx_lm.generate import batch_generate

    prompts, outputs = workload(sz, model.config.vocab_size)
    longest = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    num_pages = MAX_NUM_SEQS * blocks_needed(longest, PAGE_SIZE)
    lm = mlx_lm_model(model)
    runs: list[Any] = []
    for label, opts in CONFIGS:
        paged = opts.get("kv_cache", "paged") == "paged"
        engine = LLMEngine(model, tokenizer, max_num_seqs=MAX_NUM_SEQS,
                           max_model_len=sz["max_model_len"],
                           **(dict(num_pages=num_pages) if paged else {}), **opts)
        runs.append(EngineRun(label, engine, prompts, outputs))
    runs.append(MlxLmRun(lm, prompts, outputs))
    ext = extension()
    copies_before = ext.pool_copies()
    probe = GemmProbe(model)
    loops = 0
    while True:
        active = [r for r in runs if not r.done()]
        if not active:
            break
        for run in active:
            run.step()
            if run.label == "final" and len(run.steps) % 2 == 0:  # its GEMMs alone, now
                last = run.steps[-1]
                last["gemm_alone"] = probe.time(last["tokens"], max(1, last["sampled"]))
        loops += 1
        if loops % 25 == 0:
            print(f"  progression: {loops} rounds, " + ", ".join(
                f"{r.label} {r.clock:.0f} s" for r in runs), flush=True)
    pool_copies = ext.pool_copies() - copies_before

    plain = None
    if sz["plain_batch_generate"]:
        start = time.perf_counter()
        resp = batch_generate(lm, StubTokenizer(), prompts, max_tokens=outputs,
                              return_token_ids=True, completion_batch_size=MAX_NUM_SEQS,
                              prefill_batch_size=MAX_NUM_SEQS)
        wall = time.perf_counter() - start
        generated = sum(map(len, resp.token_ids))
        plain = dict(seconds=wall, generated=generated, tok_per_s=generated / wall,
                     prompt_tps=resp.stats.prompt_tps, generation_tps=resp.stats.generation_tps,
                     prompt_time=resp.stats.prompt_time,
                     generation_time=resp.stats.generation_time,
                     token_ids=resp.token_ids)

    base = runs[0]
    base_tokens = [base.tokens[r] for r in base.rids]
    results: dict[str, Any] = {}
    for run in runs:
        ids = run.uids if isinstance(run, MlxLmRun) else run.rids
        s = summarize(run, ids)
        toks = [run.tokens[i] for i in ids]
        s["tokens_match"] = sum(a == b for a, b in zip(toks, base_tokens, strict=True))
        s["peak_kv_alloc"] = run.peak_alloc
        if isinstance(run, EngineRun):
            st = run.engine.stats()
            s.update(peak_kv_live=run.peak_live,
                     copied_per_step=statistics.fmean(x["copied"] for x in run.steps),
                     copied_total=sum(x["copied"] for x in run.steps),
                     prompt_tokens_computed=st["num_prompt_tokens_computed"],
                     preemptions=st["num_preemptions"],
                     prefix_hit_tokens=st.get("prefix_cache_hit_tokens"),
                     breakdown=breakdown(run.steps), step_records=run.steps)
        results[run.label] = s
    if plain is not None:
        plain["tokens_match"] = sum(a == b for a, b in zip(plain.pop("token_ids"), base_tokens,
                                                          strict=True))
    mib = 2**20
    first = results["static"]
    rows = []
    for label, s in results.items():
        rows.append([label, s["tok_per_s"], s["tok_per_s"] / first["tok_per_s"],
                     s["ttft_p50"], s["ttft_p99"], s["itl_p50"] * 1e3, s["itl_p99"] * 1e3,
                     s["peak_kv_alloc"] / mib,
                     None if s.get("peak_kv_live") is None else s["peak_kv_live"] / mib,
                     None if "copied_per_step" not in s else s["copied_per_step"] / mib,
                     s.get("prompt_tokens_computed"), s["steps"],
                     f"{s['tokens_match']}/{len(prompts)}"])
    if plain is not None:
        rows.append(["mlx-lm batch_generate (alone)", plain["tok_per_s"],
                     plain["tok_per_s"] / first["tok_per_s"], None, None, None, None, None,
                     None, None, None, None, f"{plain['tokens_match']}/{len(prompts)}"])
    n_prefixed = (len(prompts) + 1) // 2
    t_main = Table(
        f"3. The progression on one workload: {len(prompts)} requests at t=0, prompts "
        f"{sz['prompt'][0]}-{sz['prompt'][1]} tokens ({n_prefixed} of them starting with the "
        f"same {sz['prefix']}-token system prefix), outputs {sz['output'][0]}-"
        f"{sz['output'][1]} tokens (greedy, ignore_eos), max_num_seqs={MAX_NUM_SEQS}",
        ["configuration", "output tok/s", "x static", "TTFT p50 s", "TTFT p99 s",
         "ITL p50 ms", "ITL p99 ms", "peak KV MiB alloc", "peak KV MiB live",
         "attention MiB copied / step", "prompt tokens computed", "steps",
         "tokens = static"],
        rows,
        ["", ".1f", ".2f", ".2f", ".2f", ".0f", ".0f", ".1f", ".1f", ".2f", "", "", ""],
        "All rows but the last were stepped round-robin in one loop, each on its own clock "
        "(sum of its step times; all requests arrive at 0). Paged rows: pool of "
        f"{num_pages} pages x {PAGE_SIZE} tokens ({MAX_NUM_SEQS} x the longest request), "
        "prefix caching on; 'alloc' is stats()['kv_cache_bytes'] (the pool, or the dense "
        "buffers as grown), 'live' the K/V of tokens stored (paged: referenced pages). "
        "Copied / step: gather = context rows x all layers x K+V per step; dense = buffer "
        "growth (concatenate) copies; direct paged / final write in place (kernel "
        f"pool_copies() during the loop: {pool_copies}). mlx-lm: BatchGenerator with the same "
        "float32 arrays, completion/prefill batch 8, prefill_step_size 2048 (whole prompts, "
        "left-padded per batch), no prefix cache, no stop tokens, each step ended with "
        "mx.synchronize so the step it queued with async_eval runs on its own clock; 'peak KV "
        "alloc' is its prompt_cache_nbytes. The last row is one plain "
        "mlx_lm.generate.batch_generate call, timed wall-clock alone after the loop (tok/s = "
        "generated tokens / call time; not interleaved, so exposed to the load of the moment).",
    )
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rows = []
    for label, s in results.items():
        for kind, b in s.get("breakdown", {}).items():
            rows.append([label, kind, b["n"], b["tokens"], b["seconds"] * 1e3,
                         b["schedule"] * 1e3, b["metadata"] * 1e3, b["layout"] * 1e3,
                         b["graph"] * 1e3, b["eval"] * 1e3, b["sample_update"] * 1e3,
                         (b["seconds"] - b["eval"]) / b["seconds"],
                         weight_bytes / b["eval"] / 1e9 if kind == "decode" else None])
    t_steps = Table(
        "3b. Where a step's time goes (mean ms per step; decode = steps with only decode "
        "tokens, prefill = steps with any prefill chunk)",
        ["configuration", "step kind", "n", "tokens / step", "step ms", "schedule",
         "block tables", "batch layout", "graph build", "forward eval", "sample + update",
         "non-eval share", "weights GB/s in eval"],
        rows,
        ["", "", "", ".0f", ".1f", ".2f", ".2f", ".2f", ".1f", ".1f", ".2f", ".2f", ".1f"],
        "schedule: Scheduler.schedule(); block tables: kv.batch() (slot mapping, block "
        "tables, context lengths as MLX arrays); batch layout: the rest of the engine's "
        "_forward in Python (token ids, positions, logit rows); graph build: the model call "
        "building the lazy MLX graph; forward eval: mx.eval of the logits (all layers' "
        "compute); sample + update: argmax, appending tokens, stop checks, outputs. "
        "Non-eval share = (step - forward eval) / step: Python and MLX dispatch overhead. "
        f"Weights GB/s: the model's {weight_bytes / 1e6:.0f} MB of weights, which every "
        "decode step streams once, / forward eval time.",
    )
    shares = gemm_share(results["final"]["step_records"])
    rows = [[kind, g["n"], g["tokens"], g["step"] * 1e3, g["eval"] * 1e3, g["gemm"] * 1e3,
             g["gemm"] / g["eval"], (g["eval"] - g["gemm"]) * 1e3, (g["step"] - g["eval"]) * 1e3]
            for kind, g in shares.items()]
    t_gemm = Table(
        "3c. The final engine's forward vs its matmuls alone (every 2nd step of the final "
        "configuration, each followed at once by the same step's GEMMs on random inputs)",
        ["step kind", "steps sampled", "tokens / step", "step ms", "forward eval ms",
         "GEMMs alone ms", "GEMM share of eval", "rest of eval ms", "outside eval ms"],
        rows,
        ["", "", ".0f", ".1f", ".1f", ".1f", ".2f", ".1f", ".1f"],
        f"GEMMs alone: the {len(probe.weights)} linear layers at the step's token count plus "
        "the tied vocabulary projection at one row per sampled sequence, evaluated in one "
        "mx.eval. Rest of eval: attention (kernel), K/V page writes, RMSNorm, RoPE, SiLU, "
        "residual adds, embedding lookup. Outside eval: scheduler, metadata, graph "
        "construction, sampling and bookkeeping (table 3b).",
    )
    data = dict(configs=[dict(label=label, options=opts) for label, opts in CONFIGS],
                workload=dict(prompt_lens=[len(p) for p in prompts], outputs=outputs,
                              prefix=sz["prefix"]),
                num_pages=num_pages, results=results, batch_generate=plain,
                weight_bytes=weight_bytes, final_gemm_share=shares,
                kernel_pool_copies=pool_copies)
    return data, [t_main, t_steps, t_gemm]


# ------------------------------------------------------------------ figure and main


def make_figure(attn: list[dict], ttft: list[dict], prog: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, L in enumerate(sorted({d["query_len"] for d in attn})):
        pts = [d for d in attn if d["query_len"] == L]
        for impl, style in (("kernel", "-o"), ("mx.fast", "--s"), ("reference", ":^")):
            xy = [(d["context"], d["median_s"][impl] * 1e3) for d in pts if impl in d["median_s"]]
            if xy:
                ax.plot(*zip(*xy, strict=True), style, color=colors[i % len(colors)],
                        label=f"{impl}, L={L}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context S (tokens)")
    ax.set_ylabel("ms (one layer)")
    ax.set_title("Prefill attention: L query tokens at the end of S")
    ax.legend(fontsize=7, ncol=2)

    ax = axes[0][1]
    ns = [d["prompt_tokens"] for d in ttft]
    x = np.arange(len(ns))
    for off, impl, label in ((-0.2, "reference", "Day 4 (page walk)"),
                             (0.2, "kernel", "Day 5 (tiled kernel)")):
        vals = [d["median_s"].get(impl, np.nan) for d in ttft]
        ax.bar(x + off, vals, 0.4, label=label)
    ax.set_xticks(x, [str(n) for n in ns])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT of one long prompt (missing bar: not run)")
    ax.legend(fontsize=8)

    labels = list(prog["results"])
    x = np.arange(len(labels))
    for ax, key, ylabel in ((axes[1][0], "tok_per_s", "output tok/s"),
                            (axes[1][1], "ttft_p50", "TTFT p50 (s)")):
        vals = [prog["results"][k][key] for k in labels]
        ax.bar(x, vals, color=[colors[1] if k == "mlx-lm" else colors[0] for k in labels])
        if key == "tok_per_s" and prog.get("batch_generate"):
            ax.axhline(prog["batch_generate"]["tok_per_s"], color=colors[1], ls="--",
                       label="mlx-lm batch_generate, alone")
            ax.legend(fontsize=8)
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Progression: {ylabel}")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    args = ap.parse_args()
    sz = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    ext_info = pin_extension()
    model, _, model_name = load_model(args.quick, vocab_size=512, tie_word_embeddings=True)
    tokenizer = StubTokenizer()
    warm = LLMEngine(model, tokenizer, max_num_seqs=4, max_model_len=512, num_pages=64)
    warm.generate([list(range(1, 100)), list(range(5, 60))], greedy(4), use_tqdm=False)
    t = lap(timings, "load+warmup", t_start)

    attn_data, attn_table = prefill_attention(sz)
    t = lap(timings, "prefill attention", t)
    ttft_data, ttft_table = ttft_long(model, tokenizer, sz)
    t = lap(timings, "TTFT long prompts", t)
    prog_data, prog_tables = progression(model, tokenizer, sz)
    t = lap(timings, "progression", t)

    timings["total"] = time.perf_counter() - t_start
    data = dict(model=model_name, sizes=sz, page_size=PAGE_SIZE, extension=ext_info,
                kv_bytes_per_token=kv_bytes_per_token(model.config, model.dtype),
                prefill_attention=attn_data, ttft_long=ttft_data, progression=prog_data,
                seconds=timings)
    fig = make_figure(attn_data, ttft_data, prog_data)
    save_results(NAME + ("_quick" if args.quick else ""), data,
                 [attn_table, ttft_table, *prog_tables], fig)
    print(f"total {timings['total']:.0f} s")


if __name__ == "__main__":
    main()
