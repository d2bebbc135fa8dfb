"""Week 3, Day 5: tiles against vectors (the FlashAttention schedule against Day 4's), and the
whole course's progression of engine configurations on one workload, next to mlx-lm.

Three measurements; in each, the configurations compared run in the same process,
interleaved, and ratios are taken within the run.

1. **Prefill attention, one layer** (SmolLM2's heads: 9 query / 3 KV heads, head_dim 64,
   float32, page_size 16, pages of the sequence in shuffled pool order). A query of ``L``
   tokens at the end of a context of ``S`` tokens (query row ``i`` sits at position
   ``S - L + i`` and sees keys ``0 .. S - L + i``), computed by:

   - ``Day 4 vector kernel``: ``paged_attention`` (the extension op with ``tiled=False``:
     the vector schedule for every row, each row walking its own pages);
   - ``Day 5 tiled kernel``: ``paged_attention`` with ``tiled=True`` (the same op:
     tiles of 16 consecutive query rows share every page they read);
   - both kernels with the extension's worker pool limited to **1 thread** and on **every
     core** (``extension().set_num_threads(n)``);
   - ``MLX reference walk``: ``paged_attention_reference`` (Day 4's page walk in MLX ops,
     one page column per iteration, every row gathering its own copy of the page) and
     ``MLX tiled reference walk``: ``paged_flash_reference`` (Day 5's tiles in MLX ops);
     skipped where ``L x S`` exceeds ``ref_max_units``;
   - ``mx.fast``: ``mx.fast.scaled_dot_product_attention`` on dense, contiguous K/V
     (``[1, H, S, D]``, gathered from the pages before timing), with ``mask="causal"`` when
     ``L == S`` and otherwise an explicit boolean ``[L, S]`` mask ``key <= S - L + row``
     (built and evaluated before timing). It runs on MLX's one CPU stream thread (OpenBLAS
     on one thread by default), so kernel / mx.fast is reported at equal threads (the
     kernel on 1 thread) and, labelled as such, with the kernel on every core.

   Tiles vs vectors is the tiled kernel's time over the vector kernel's at the same thread
   count. Points with ``L x S > attn_max_units`` are not run. All outputs are checked
   against ``mx.fast`` (max abs error).

2. **TTFT of one long prompt** (random token ids, ``max_tokens=1``, engine defaults: paged
   KV, chunked prefill with the default budget of 512 tokens per step, prefix caching on
   but nothing to hit), with ``attention="vector"`` (Day 4's kernel: the vector schedule
   for every row), ``attention="flash"`` (Day 5's kernel: tiles for the prefill chunks),
   and the MLX walks ``"page_walk"`` and ``"tiled_walk"`` (skipped above
   ``ttft_ref_max`` tokens: their page walks copy pages per row or per tile). The kernels
   use every core. TTFT = wall time from the first ``engine.step()`` to the step that
   returns the first token (the request is added just before).

3. **The progression on one workload**: requests arriving at t=0 (prompts of random token
   ids, the first ``prefix`` of them a shared system prefix in half of the requests;
   outputs fixed by ``max_tokens`` with ``ignore_eos``, greedy), through these engine
   configurations, all with ``max_num_seqs=8``:

   ==============================  ============================================================
   static                          scheduler="static", kv_cache="dense", no chunked prefill,
                                   max_num_batched_tokens=4096 (a budget that never binds)
   continuous                      scheduler="continuous", dense, no chunking, budget 4096
   chunked                         kv_cache="dense", chunked prefill, default budget (512)
   paged + gather                  attention="gather" (Day 3), prefix caching off
   paged + gather, prefix cache    the same with prefix caching on
   paged + MLX walk                attention="page_walk" (Day 4's MLX page walk), prefix off
   paged + vector kernel           attention="vector" (Day 4's kernel), prefix off
   paged + tiled kernel            attention="flash" (Day 5's kernel), prefix off
   final                           the defaults: attention="flash", prefix caching on
   ==============================  ============================================================

   The paged rows with prefix caching off differ only in their attention path; the two
   pairs (gather, tiled kernel) with it off and on differ only in prefix caching, whose
   effect is the prompt tokens it saves computing (recorded per configuration, with the
   prefix-cache hit tokens). Paged rows get ``num_pages = max_num_seqs x pages of the
   longest request``. The engines are stepped round-robin in one loop, each on its own
   clock (the sum of its own step times), so a noisy neighbour hurts them alike.

   Reported per configuration: output tok/s; TTFT p50/p99; inter-token latency (ITL)
   p50/p99; peak KV bytes allocated (``stats()["kv_cache_bytes"]``) and live; bytes copied
   per step by attention (gather: the context rows of every scheduled sequence, all layers,
   K and V; dense: the copies made when a per-request buffer grows by 256 rows; the walks
   and kernels: none — the kernel's ``pool_copies()`` counter is checked); prompt tokens
   computed; whether each request's tokens equal the first configuration's; and where a
   step's time goes (scheduler, the KV layout — block tables and slot mapping —, the rest
   of the batch layout, the attention backend's per-step metadata, graph construction, MLX
   evaluation of the forward, sampling and bookkeeping), measured by wrapping the engine's
   public parts (``engine.scheduler.schedule``, ``engine.kv.layout``,
   ``engine.attention.begin_step``, ``engine.runner.model``).

   Then the same requests through mlx-lm with the same float32 arrays
   (``mlx_lm.models.llama.Model`` built from our ``ModelConfig``): ``BatchGenerator`` driven
   by ``batch_generate``'s loop with ``completion_batch_size=8``, ``prefill_batch_size=8``,
   its default ``prefill_step_size=2048``, greedy, no stop tokens, stepped in the same
   round-robin loop; each of its steps ends with ``mx.synchronize(gen.stream)`` (it queues
   the next step with ``mx.async_eval``, whose compute would otherwise be charged to the
   other engines). Then one plain ``batch_generate`` call, timed alone after the loop.
   Finally, every second step of the final configuration is followed at once by the same
   step's matmuls alone: how much of the forward is GEMM.

Rounds: (1) times every implementation once per round, the order rotating; (2) and (3) run
once per round; ``--rounds`` rounds (default 3), medians reported with the spread in the
JSON; counts (tokens, prompt tokens computed) are checked equal across rounds.

OpenBLAS runs with one thread (``tiny_llm``'s default unless ``OPENBLAS_NUM_THREADS`` is
set). The script loads a private copy of the built extension (its sha256 is recorded) so
that a rebuild of ``src/extensions`` during the run cannot crash it.

    python benches/bench_week3_day5.py           # SmolLM2-135M, about 15 minutes on 2 cores
    python benches/bench_week3_day5.py --quick   # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tiny_llm
from tiny_llm import IncrementalDetokenizer, LLMEngine, Model, extension, kv_bytes_per_token
from tiny_llm.day3_paged_kv import blocks_needed
from tiny_llm.day4_paged_attention import paged_attention, paged_attention_reference
from tiny_llm.day5_paged_flash import (
    TiledWalkAttention,
    paged_flash_reference,
)
from tiny_llm.kernels.cpu_kernels import kernels_available

import mlx.core as mx
import numpy as np
from common import (
    GemmProbe,
    Table,
    TimedModel,
    bench_device,
    bench_parser,
    gpu_words,
    greedy,
    kernel_thread_counts,
    lap,
    load_model,
    mlx_cpu_threads,
    mlx_lm_model,
    percentile,
    save_results,
    spread,
    threads_label,
    with_threads,
)
from mlx.utils import tree_flatten

NAME = "bench_week3_day5"
PAGE_SIZE = 16
HEADS = (9, 3, 64)  # SmolLM2: query heads, KV heads, head_dim
MAX_NUM_SEQS = 8
NO_CHUNK_BUDGET = 4096
# The kernels' thread counts on the CPU (1 and every core); one run (None) on a GPU.
THREADS = kernel_thread_counts()
ON_CPU = bench_device() == "cpu"

FULL = dict(
    attn_queries=[64, 256, 1024],
    attn_contexts=[256, 1024, 2048, 4096, 8192],
    attn_max_units=1024 * 2048,  # skip kernel/mx.fast points with L x S above this
    ref_max_units=1024 * 1024,  # skip the MLX reference walks above this L x S
    ttft_prompts=[1024, 2048],
    ttft_ref_max=1024,
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
    ttft_prompts=[128, 256],
    ttft_ref_max=256,
    requests=16,  # more than max_num_seqs: the later ones can hit the prefix cache
    prompt=(16, 64),
    prefix=32,
    output=(4, 12),
    max_model_len=256,
    plain_batch_generate=True,
)

PAGED_OFF = dict(kv_cache="paged", enable_prefix_caching=False)
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("static", dict(scheduler="static", kv_cache="dense", enable_chunked_prefill=False,
                    max_num_batched_tokens=NO_CHUNK_BUDGET)),
    ("continuous", dict(scheduler="continuous", kv_cache="dense", enable_chunked_prefill=False,
                        max_num_batched_tokens=NO_CHUNK_BUDGET)),
    ("chunked", dict(kv_cache="dense", enable_chunked_prefill=True)),
    ("paged + gather", dict(PAGED_OFF, attention="gather")),
    ("paged + gather, prefix cache", dict(kv_cache="paged", attention="gather",
                                          enable_prefix_caching=True)),
    ("paged + MLX walk", dict(PAGED_OFF, attention="page_walk")),
    ("paged + vector kernel", dict(PAGED_OFF, attention="vector")),
    ("paged + tiled kernel", dict(PAGED_OFF, attention="flash")),
    ("final (tiled kernel, prefix cache)", dict()),
]
FINAL = CONFIGS[-1][0]

TTFT_PATHS = {  # attention option -> label
    "vector": "Day 4 vector kernel",
    "flash": "Day 5 tiled kernel",
    "page_walk": "MLX reference walk",
    "tiled_walk": "MLX tiled reference walk",
}
MLX_WALKS = ("page_walk", "tiled_walk")


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
    """What the engine and mlx-lm need from a tokenizer when prompts are token ids: no text,
    so that decoding costs neither engine anything (the chapter times the steps)."""

    eos_token_ids: set[int] = set()

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(lambda ids: "")

    def decode(self, ids: list[int]) -> str:
        return ""


# ------------------------------------------------------------------ 1. prefill attention


def short(threads: int | None) -> str:
    """"1T", "2T", or on a GPU "GPU": what ran."""
    return f"{threads}T" if threads is not None else threads_label(None)


def vector_name(threads: int | None) -> str:
    return f"Day 4 vector kernel, {short(threads)}"


def tiled_name(threads: int | None) -> str:
    return f"Day 5 tiled kernel, {short(threads)}"


def prefill_attention(sz: dict[str, Any], rounds: int) -> tuple[list[dict[str, Any]], Table]:
    hq, hkv, hd = HEADS
    scale = hd**-0.5
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
        args = (q, k_pages, v_pages, block_table, context_lens, qsl, scale)

        def vector(args=args):
            return paged_attention(*args, validate=False)

        def tiled(args=args):
            return paged_attention(*args, validate=False, tiled=True)

        def fast(q=q_dense, k=k_dense, v=v_dense, mask=mask):
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            return out[0].transpose(1, 0, 2)

        impls: dict[str, Callable[[], mx.array]] = {}
        for n in THREADS:
            impls[vector_name(n)] = with_threads(vector, n)
            impls[tiled_name(n)] = with_threads(tiled, n)
        impls["mx.fast"] = fast
        if L * S <= sz["ref_max_units"]:
            impls["MLX reference walk"] = lambda args=args: paged_attention_reference(*args)
            impls["MLX tiled reference walk"] = lambda args=args: paged_flash_reference(
                *args, tile_rows=TiledWalkAttention.TILE_ROWS)
        oracle = fast()
        errors = {name: mx.abs(fn() - oracle).max().item()  # also the warmup call
                  for name, fn in impls.items() if name != "mx.fast"}
        times: dict[str, list[float]] = {name: [] for name in impls}
        names = list(impls)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                start = time.perf_counter()
                mx.eval(impls[name]())
                times[name].append(time.perf_counter() - start)
        t = {name: statistics.median(v) for name, v in times.items()}
        d = dict(query_len=L, context=S, times=times, median_s=t, max_abs_err=errors,
                 spread={name: spread(v) for name, v in times.items()})
        data.append(d)
        ref, tref = t.get("MLX reference walk"), t.get("MLX tiled reference walk")
        rows.append([L, S, *(t[vector_name(n)] * 1e3 for n in THREADS),
                     *(t[tiled_name(n)] * 1e3 for n in THREADS), t["mx.fast"] * 1e3,
                     None if ref is None else ref * 1e3, None if tref is None else tref * 1e3,
                     *(t[tiled_name(n)] / t[vector_name(n)] for n in THREADS),
                     *(t[tiled_name(n)] / t["mx.fast"] for n in THREADS),
                     max(errors.values())])
        print(f"  attention L={L} S={S}: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in t.items()), flush=True)
        del k_pages, v_pages, k_dense, v_dense, mask
    skipped = [f"{q}x{s}" for q in sz["attn_queries"] for s in sz["attn_contexts"]
               if q <= s and q * s > sz["attn_max_units"]]
    fast = f"mx.fast ({mlx_cpu_threads()}T)" if ON_CPU else "mx.fast"
    if ON_CPU:
        threads_note = (
            "page); " + " / ".join(map(short, THREADS)) + ": the extension's worker pool "
            "limited to " + " / ".join(threads_label(n) for n in THREADS) + " "
            "(set_num_threads). mx.fast: mx.fast.scaled_dot_product_attention on contiguous "
            "dense K/V (mask='causal' when L == S, else an explicit boolean [L, S] mask), on "
            f"MLX's one CPU stream thread with OpenBLAS on {mlx_cpu_threads()} thread(s): "
            "compare it with the kernels at as many threads. ")
    else:
        threads_note = (
            f"page), run {gpu_words()}. mx.fast: mx.fast.scaled_dot_product_attention on "
            "contiguous dense K/V (mask='causal' when L == S, else an explicit boolean [L, S] "
            "mask), on the same device. ")
    table = Table(
        f"1. Tiles vs vectors: prefill attention, one layer ({hq} q / {hkv} kv heads, "
        f"head_dim {hd}, float32, page_size {PAGE_SIZE}, shuffled pages), a query of L "
        f"tokens at the end of a context of S tokens (ms)",
        ["L", "S", *map(vector_name, THREADS), *map(tiled_name, THREADS), fast,
         "MLX reference walk", "MLX tiled reference walk",
         *(f"tiled / vector, {short(n)}" for n in THREADS),
         *(f"tiled {short(n)} / {fast}" + (" (equal threads)" if n == mlx_cpu_threads()
                                            else "")
           for n in THREADS), "max abs err"],
        rows,
        ["", "", *[".2f"] * (2 * len(THREADS) + 1), ".1f", ".1f",
         *[".2f"] * (2 * len(THREADS)), ".1e"],
        "Day 4 vector kernel: paged_attention (tiled=False, every row walks its pages); Day 5 "
        "tiled kernel: paged_attention (tiled=True, 16-row query tiles share each "
        + threads_note + "MLX reference walks: the page walk (Day 4) and the tiled walk (Day 5) in "
        f"MLX ops, run only where L x S <= {sz['ref_max_units']} ('–' elsewhere). Median "
        f"of {rounds} interleaved rounds, each after one warmup call. Max abs err: largest "
        "of every implementation vs mx.fast."
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


def ttft_long(model: Model, tokenizer: Any, sz: dict[str, Any], rounds: int
              ) -> tuple[list[dict], Table]:
    rng = random.Random(2)
    vocab = model.config.vocab_size
    prompts = {n: [rng.randrange(vocab) for _ in range(n)] for n in sz["ttft_prompts"]}
    runs: dict[int, dict[str, list[dict]]] = {
        n: {a: [] for a in TTFT_PATHS if n <= sz["ttft_ref_max"] or a not in MLX_WALKS}
        for n in prompts}
    for r in range(rounds):
        for n, prompt in prompts.items():
            paths = list(runs[n])
            for att in paths[r % len(paths):] + paths[: r % len(paths)]:
                runs[n][att].append(ttft_once(model, tokenizer, prompt, att))
                print(f"  TTFT {n} tokens, {att}: {runs[n][att][-1]['seconds']:.2f} s",
                      flush=True)
    data, rows = [], []
    for n, by in runs.items():
        t = {a: statistics.median(x["seconds"] for x in v) for a, v in by.items()}
        ratio = statistics.median(v["seconds"] / f["seconds"]
                                  for v, f in zip(by["vector"], by["flash"], strict=True))
        same = len({x["token"] for v in by.values() for x in v}) == 1
        data.append(dict(prompt_tokens=n, runs=by, median_s=t, vector_over_flash=ratio,
                         same_first_token=same,
                         spread={a: spread([x["seconds"] for x in v]) for a, v in by.items()}))
        rows.append([n, by["flash"][0]["steps"], t["vector"], t["flash"], ratio,
                     t.get("page_walk"), t.get("tiled_walk"), "yes" if same else "NO"])
    table = Table(
        "2. TTFT of one long prompt: Day 4 vector kernel (attention='vector') vs Day 5 tiled "
        "kernel (attention='flash'), and the MLX reference walks ('page_walk', "
        "'tiled_walk'), chunked prefill at the default budget (512 tokens per step)",
        ["prompt tokens", "steps", "Day 4 vector kernel TTFT s", "Day 5 tiled kernel TTFT s",
         "vector / tiled", "MLX reference walk TTFT s", "MLX tiled reference walk TTFT s",
         "same first token"],
        rows,
        ["", "", ".2f", ".2f", ".2f", ".2f", ".2f", ""],
        "One request, random token ids, max_tokens=1, otherwise engine defaults (paged, "
        "prefix caching on, nothing to hit); the kernels "
        + (f"on every core ({os.cpu_count()} threads)" if ON_CPU else gpu_words())
        + ". TTFT: wall time from the first step to the token, median "
        f"of {rounds} round(s) (the paths' order rotating); vector / tiled: median of "
        "per-round ratios. The MLX walks are not run above "
        f"{sz['ttft_ref_max']} tokens ('–'): they copy a page per query row (or per tile) "
        "in every layer.",
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


class EngineRun:
    """One engine of the round-robin loop: its own clock and per-step records. Its public
    parts are wrapped (on this instance only) to time a step's phases."""

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
        self._t = dict.fromkeys(("schedule", "schedule_end", "metadata", "begin", "graph",
                                 "eval", "model_start"), 0.0)
        self._step_tokens = 0
        self.decode_rows: int | None = None  # the last step's, for its GEMMs alone
        self._decode_only = True
        self._instrument()

    def _instrument(self) -> None:
        engine, t = self.engine, self._t
        schedule, layout, begin = (engine.scheduler.schedule, engine.kv.layout,
                                   engine.attention.begin_step)

        def timed_schedule():
            start = time.perf_counter()
            chunks = schedule()
            t["schedule_end"] = time.perf_counter()
            t["schedule"] += t["schedule_end"] - start
            self._step_tokens = sum(c.num_tokens for c in chunks)
            self._decode_only = all(c.request.num_computed_tokens >= len(c.request.prompt_token_ids)
                                    for c in chunks)
            return chunks

        def timed_layout(chunks):
            start = time.perf_counter()
            out = layout(chunks)
            t["metadata"] += time.perf_counter() - start
            return out

        def timed_begin(step):
            start = time.perf_counter()
            begin(step)
            t["begin"] += time.perf_counter() - start
            # The engine's step takes the CPU kernels only where they exist (not on a GPU).
            uses_kernels = engine.config.cpu_kernels and kernels_available()
            self.decode_rows = step.decode_rows if uses_kernels else None

        engine.scheduler.schedule = timed_schedule
        engine.kv.layout = timed_layout
        engine.attention.begin_step = timed_begin
        engine.runner.model = TimedModel(engine.model, t)

    def dense_sizes(self) -> list[int]:
        return [c.nbytes() for c in self.engine.kv.caches] if self.dense else []

    @property
    def dense(self) -> bool:
        return self.engine.config.kv_cache == "dense"

    def step(self) -> None:
        for k in self._t:
            self._t[k] = 0.0
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
        copied = sum(b for b, a in zip(before, self.dense_sizes(), strict=True) if b and a > b)
        engine = self.engine
        if engine.config.attention == "gather":  # context rows of every sequence, all layers
            copied += sum(engine.attention.step.context_lens) * self.bpt
        kv, stats = engine.kv, engine.stats()
        if self.dense:
            live = sum(c.length for c in kv.caches) * self.bpt
        else:
            used = stats["num_pages"] - stats["num_free_pages"]
            live = used * self.bpt * stats["page_size"]
        self.peak_alloc = max(self.peak_alloc, stats["kv_cache_bytes"])
        self.peak_live = max(self.peak_live, live)
        t = self._t
        build = t["model_start"] - t["schedule_end"]  # StepBatch.build + begin_step
        self.steps.append(dict(
            seconds=dt, tokens=self._step_tokens, decode_only=self._decode_only,
            schedule=t["schedule"], metadata=t["metadata"], begin=t["begin"],
            layout=build - t["metadata"] - t["begin"], graph=t["graph"], eval=t["eval"],
            sample_update=dt - t["schedule"] - build - t["graph"] - t["eval"], copied=copied,
            sampled=sum(1 for o in outputs if o.new_token_ids), decode_rows=self.decode_rows,
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


BREAKDOWN = ("seconds", "schedule", "metadata", "layout", "begin", "graph", "eval",
             "sample_update")


def breakdown(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind, sel in (("decode", [s for s in steps if s["decode_only"]]),
                      ("prefill", [s for s in steps if not s["decode_only"]])):
        if sel:
            out[kind] = {k: statistics.fmean(s[k] for s in sel) for k in BREAKDOWN}
            out[kind]["n"] = len(sel)
            out[kind]["tokens"] = statistics.fmean(s["tokens"] for s in sel)
    return out


def progression_round(model: Model, tokenizer: Any, sz: dict[str, Any], lm: Any,
                      prompts: list[list[int]], outputs: list[int], num_pages: int
                      ) -> dict[str, Any]:
    """One round of (3): every configuration and mlx-lm, stepped round-robin."""
    from mlx_lm.generate import batch_generate

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
            if run.label == FINAL and len(run.steps) % 2 == 0:  # its GEMMs alone, now
                last = run.steps[-1]
                last["gemm_alone"] = probe.time(last["tokens"], max(1, last["sampled"]),
                                                last["decode_rows"])
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
                     prompt_tokens_computed=st["num_prompt_tokens_computed"],
                     preemptions=st["num_preemptions"],
                     prefix_hit_tokens=st.get("prefix_cache_hit_tokens"),
                     step_records=run.steps)
        results[run.label] = s
    if plain is not None:
        plain["tokens_match"] = sum(a == b for a, b in zip(plain.pop("token_ids"), base_tokens,
                                                          strict=True))
    return dict(results=results, batch_generate=plain, pool_copies=pool_copies)


def progression(model: Model, tokenizer: Any, sz: dict[str, Any], rounds: int
                ) -> tuple[dict[str, Any], list[Table]]:
    prompts, outputs = workload(sz, model.config.vocab_size)
    longest = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    num_pages = MAX_NUM_SEQS * blocks_needed(longest, PAGE_SIZE)
    lm = mlx_lm_model(model)
    rnds = []
    for r in range(rounds):
        rnds.append(progression_round(model, tokenizer, sz, lm, prompts, outputs, num_pages))
        print(f"  progression round {r + 1}/{rounds} done", flush=True)
    labels = list(rnds[0]["results"])
    timed = ("tok_per_s", "seconds", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
    counted = ("generated", "tokens_match", "prompt_tokens_computed", "prefix_hit_tokens",
               "steps")
    results: dict[str, Any] = {}
    for label in labels:
        first = rnds[0]["results"][label]
        s = {k: v for k, v in first.items() if k not in timed and k != "step_records"}
        for k in counted:
            if k in first and any(rnd["results"][label][k] != first[k] for rnd in rnds):
                raise RuntimeError(f"{label}: {k} differs between rounds")
        for k in timed:
            sp = spread([rnd["results"][label][k] for rnd in rnds])
            s[k], s[k + "_spread"] = sp["median"], sp
        s["x_static"] = statistics.median(rnd["results"][label]["tok_per_s"]
                                          / rnd["results"]["static"]["tok_per_s"] for rnd in rnds)
        if "step_records" in first:
            s["step_records"] = [x for rnd in rnds for x in rnd["results"][label]["step_records"]]
            s["breakdown"] = breakdown(s["step_records"])
        results[label] = s
    plain = None
    if rnds[0]["batch_generate"] is not None:
        plain = dict(rnds[0]["batch_generate"])
        sp = spread([rnd["batch_generate"]["tok_per_s"] for rnd in rnds])
        plain["tok_per_s"], plain["tok_per_s_spread"] = sp["median"], sp
        plain["x_static"] = statistics.median(rnd["batch_generate"]["tok_per_s"]
                                              / rnd["results"]["static"]["tok_per_s"]
                                              for rnd in rnds)
    pool_copies = sum(rnd["pool_copies"] for rnd in rnds)
    mib = 2**20
    options = dict(CONFIGS)
    rows = []
    for label, s in results.items():
        opts = options.get(label)
        paged = opts is not None and opts.get("kv_cache", "paged") == "paged"
        caching = (("on" if opts.get("enable_prefix_caching", True) else "off") if paged
                   else "–")
        rows.append([label, caching, s["tok_per_s"], s["x_static"],
                     s["ttft_p50"], s["ttft_p99"], s["itl_p50"] * 1e3, s["itl_p99"] * 1e3,
                     s["peak_kv_alloc"] / mib,
                     None if s.get("peak_kv_live") is None else s["peak_kv_live"] / mib,
                     None if "copied_per_step" not in s else s["copied_per_step"] / mib,
                     s.get("prompt_tokens_computed"), s.get("prefix_hit_tokens"), s["steps"],
                     f"{s['tokens_match']}/{len(prompts)}"])
    if plain is not None:
        rows.append(["mlx-lm batch_generate (alone)", "–", plain["tok_per_s"],
                     plain["x_static"], None, None, None, None, None, None, None, None, None,
                     None, f"{plain['tokens_match']}/{len(prompts)}"])
    n_prefixed = (len(prompts) + 1) // 2
    t_main = Table(
        f"3. The progression on one workload: {len(prompts)} requests at t=0, prompts "
        f"{sz['prompt'][0]}-{sz['prompt'][1]} tokens ({n_prefixed} of them starting with the "
        f"same {sz['prefix']}-token system prefix, {sum(map(len, prompts))} prompt tokens in "
        f"all), outputs {sz['output'][0]}-{sz['output'][1]} tokens (greedy, ignore_eos), "
        f"max_num_seqs={MAX_NUM_SEQS}",
        ["configuration", "prefix caching", "output tok/s", "x static", "TTFT p50 s",
         "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "peak KV MiB alloc", "peak KV MiB live",
         "attention MiB copied / step", "prompt tokens computed", "prefix cache hit tokens",
         "steps", "tokens = static"],
        rows,
        ["", "", ".1f", ".2f", ".2f", ".2f", ".0f", ".0f", ".1f", ".1f", ".2f", "", "", "",
         ""],
        "All rows but the last were stepped round-robin in one loop, each on its own clock "
        "(sum of its step times; all requests arrive at 0); medians of "
        f"{rounds} round(s), 'x static' the median of per-round ratios. Paged rows: pool of "
        f"{num_pages} pages x {PAGE_SIZE} tokens ({MAX_NUM_SEQS} x the longest request); "
        "the paged rows with prefix caching off differ only in attention (gather: Day 3; "
        "MLX walk: Day 4's page walk in MLX ops; vector kernel: Day 4; tiled kernel: Day "
        "5), and each off/on pair only in prefix caching, whose effect shows in the prompt "
        "tokens computed. 'alloc' is stats()['kv_cache_bytes'] (the pool, or the dense "
        "buffers as grown), 'live' the K/V of tokens stored (paged: referenced pages). "
        "Copied / step: gather = context rows x all layers x K+V per step; dense = buffer "
        "growth (concatenate) copies; walks and kernels write in place (kernel "
        f"pool_copies() during the loops: {pool_copies}). mlx-lm: BatchGenerator with the "
        "same float32 arrays, completion/prefill batch 8, whole prompts left-padded per "
        "batch, no prefix cache, no stop tokens, each step ended with mx.synchronize; "
        "'peak KV alloc' is its prompt_cache_nbytes. The last row is one plain "
        "mlx_lm.generate.batch_generate call per round, timed alone after the loop.",
    )
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rows = []
    for label, s in results.items():
        for kind, b in s.get("breakdown", {}).items():
            rows.append([label, kind, b["n"], b["tokens"], b["seconds"] * 1e3,
                         b["schedule"] * 1e3, b["metadata"] * 1e3, b["layout"] * 1e3,
                         b["begin"] * 1e3, b["graph"] * 1e3, b["eval"] * 1e3,
                         b["sample_update"] * 1e3, (b["seconds"] - b["eval"]) / b["seconds"],
                         weight_bytes / b["eval"] / 1e9 if kind == "decode" else None])
    t_steps = Table(
        "3b. Where a step's time goes (mean ms per step over all rounds; decode = steps with "
        "only decode tokens, prefill = steps with any prefill chunk)",
        ["configuration", "step kind", "n", "tokens / step", "step ms", "schedule",
         "KV layout", "batch layout", "attention metadata", "graph build", "forward eval",
         "sample + update", "non-eval share", "weights GB/s in eval"],
        rows,
        ["", "", "", ".0f", ".1f", ".2f", ".2f", ".2f", ".2f", ".1f", ".1f", ".2f", ".2f",
         ".1f"],
        "schedule: engine.scheduler.schedule(); KV layout: engine.kv.layout() (block tables "
        "and slot mapping, or the dense caches); batch layout: the rest of StepBatch.build "
        "(token ids, positions, logit rows); attention metadata: the backend's begin_step "
        "(gather slot lists, page-walk tables, kernel metadata arrays); graph build: the "
        "model call building the lazy MLX graph; forward eval: mx.eval of the logits (all "
        "layers' compute); sample + update: sampling, appending tokens, stop checks, "
        "outputs. Non-eval share = (step - forward eval) / step: Python and MLX dispatch "
        f"overhead. Weights GB/s: the model's {weight_bytes / 1e6:.0f} MB of weights, which "
        "every decode step streams once, / forward eval time.",
    )
    shares = gemm_share(results[FINAL]["step_records"])
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
        "GEMMs alone: every linear layer at the step's token count plus the tied vocabulary "
        "projection at one row per sampled sequence, evaluated 16 MB of outputs at a time "
        "(so that they are reused as a forward's are). Rest of "
        "eval: attention (kernel), K/V page writes, RMSNorm, RoPE, SiLU, residual adds, "
        "embedding lookup. Outside eval: scheduler, metadata, graph construction, sampling "
        "and bookkeeping (table 3b).",
    )
    for s in results.values():
        s.pop("step_records", None)
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
    one = THREADS[0]
    for i, L in enumerate(sorted({d["query_len"] for d in attn})):
        pts = [d for d in attn if d["query_len"] == L]
        for impl, style in ((tiled_name(one), "-o"), (vector_name(one), "-.d"),
                            ("mx.fast", "--s"), ("MLX tiled reference walk", ":^")):
            xy = [(d["context"], d["median_s"][impl] * 1e3) for d in pts if impl in d["median_s"]]
            if xy:
                ax.plot(*zip(*xy, strict=True), style, color=colors[i % len(colors)],
                        label=f"{impl}, L={L}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context S (tokens)")
    ax.set_ylabel("ms (one layer)")
    ax.set_title(f"Prefill attention: L query tokens at the end of S ({threads_label(one)})")
    ax.legend(fontsize=6, ncol=2)

    ax = axes[0][1]
    ns = [d["prompt_tokens"] for d in ttft]
    x = np.arange(len(ns))
    width = 0.8 / len(TTFT_PATHS)
    for i, (att, label) in enumerate(TTFT_PATHS.items()):
        vals = [d["median_s"].get(att, np.nan) for d in ttft]
        ax.bar(x + (i - (len(TTFT_PATHS) - 1) / 2) * width, vals, width, label=label)
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
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(f"Progression: {ylabel}")
    fig.tight_layout()
    return fig


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    sz = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    ext_info = pin_extension()
    model, _, model_name = load_model(args.quick, vocab_size=512, tie_word_embeddings=True)
    tokenizer = StubTokenizer()
    warm = LLMEngine(model, tokenizer, max_num_seqs=4, max_model_len=512, num_pages=64)
    warm.generate([list(range(1, 100)), list(range(5, 60))], greedy(4), use_tqdm=False)
    t = lap(timings, "load+warmup", t_start)

    attn_data, attn_table = prefill_attention(sz, args.rounds)
    t = lap(timings, "prefill attention", t)
    ttft_data, ttft_table = ttft_long(model, tokenizer, sz, args.rounds)
    t = lap(timings, "TTFT long prompts", t)
    prog_data, prog_tables = progression(model, tokenizer, sz, args.rounds)
    t = lap(timings, "progression", t)

    timings["total"] = time.perf_counter() - t_start
    data = dict(model=model_name, sizes=sz, page_size=PAGE_SIZE, extension=ext_info,
                kernel_threads=THREADS,
                kv_bytes_per_token=kv_bytes_per_token(model.config, model.dtype),
                prefill_attention=attn_data, ttft_long=ttft_data, progression=prog_data,
                seconds=timings)
    fig = make_figure(attn_data, ttft_data, prog_data)
    save_results(NAME + ("_quick" if args.quick else ""), data,
                 [attn_table, ttft_table, *prog_tables], fig, rounds=args.rounds)
    print(f"total {timings['total']:.0f} s")


if __name__ == "__main__":
    main()
