"""The foundation benchmark: batch-1 prefill and decode speed of the default model on the CPU.

Configurations, all with float32 activations, SmolLM2-135M-Instruct (GGUF) weights:

- ``a``: quantized weights as stored (4-bit linear layers, 8-bit embedding; MLX's CPU
  ``quantized_matmul``), OpenBLAS loaded (it only serves the attention matmuls here);
- ``b``: float32 weights, MLX's reference BLAS (``TINY_LLM_NO_OPENBLAS=1``);
- ``c``: float32 weights with OpenBLAS interposed: what ``import tiny_llm`` does by default
  (OpenBLAS on one thread, see ``tiny_llm/kernels/blas.py``);
- ``cN``: (c) with OpenBLAS on every core (``OPENBLAS_NUM_THREADS`` = core count): its
  worker threads spin while they wait, and this shows what the one-thread default saves
  (or costs, on an idle machine);
- ``mlxlm``: mlx-lm's ``llama.Model`` built from our ``ModelConfig`` and loaded with the
  very same float32 arrays as (c), OpenBLAS interposed, driven by mlx-lm's ``generate_step``
  (the loop its ``stream_generate`` wraps; we call it directly because ``stream_generate``
  stops at EOS, and greedy SmolLM2 may emit EOS before 128 tokens).

Serving contention (configurations (c) and (cN) only): the same process then serves
``--serve-requests`` (8) requests at once through ``LLMEngine`` (engine defaults: paged KV,
the tiled kernel on its worker threads, chunked prefill; prefix caching off), prompts of
``prompt-tokens / 4`` (at least 32) tokens and ``decode-tokens / 4`` (at least 8) new
tokens each (greedy, ``ignore_eos``). Reported: output tok/s (all new tokens / wall time),
the median decode step, TTFT p50. OpenBLAS one thread vs every core is thus recorded both
for a single stream and under serving, where OpenBLAS's spinning workers compete with MLX's
stream thread and the kernels' workers: the contention the one-thread default is chosen
for.

What is timed, the same way for everyone: one greedy request with a ``--prompt-tokens``
(512) prompt and ``--decode-tokens`` (128) new tokens. Ours runs through
``tiny_llm.engine.generate.stream_generate`` (model + ``DenseKVCache`` + sampler + detokenizer:
what a user gets). Prefill tok/s = prompt tokens / time to the first new token (the
prompt runs in one forward; mlx-lm runs it as one forward of all but the last token, then
the last token with the first sampling step). Decode tok/s = (new tokens - 1) / time from
the first to the last new token, i.e. per decode step. These are the definitions of
mlx-lm's ``prompt_tps`` and ``generation_tps``, except that mlx-lm divides by one token
too many. Each measured request follows a short warmup request in the same process.

OpenBLAS is interposed at ``import tiny_llm`` and cannot be undone, so every configuration
runs in a fresh subprocess of this script (``--config X`` prints one JSON line). Rounds
are interleaved (``--rounds``, default 3; every configuration once per round, the order
reversed every other round) so that a noisy neighbour hurts them all alike; ratios to (c)
are computed within each round and their median is reported (the JSON keeps every
round's values). (a) and (b) take minutes per run,
so they run in the first ``--slow-rounds`` rounds only (default 1: they are 7-50x slower
than (c), so noise does not change their story; pass ``--slow-rounds 3`` on a quiet
machine).

Decode bound: decode reads every weight once per token (the tied embedding as the LM
head's matrix, plus one row for the lookup). Bytes read per token / copy bandwidth (a
256 MB numpy copy, counting bytes read + written) gives the bound in tok/s, if decode
were limited by memory bandwidth alone. K/V reads are left out (about 5% at this length).

    python benches/bench_model.py            # full run: about 10 minutes on 2 cores
    python benches/bench_model.py --quick    # smoke run, writes bench_model_quick.*

``--quick`` keeps the default model but shrinks the workload (64-token prompt, 8 new
tokens, 4 served requests), skips (a) and (b) unless ``--slow-rounds`` is given, and runs
one round unless ``--rounds`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from tiny_llm import openblas_threads

import numpy as np
from common import (
    Table,
    bench_parser,
    copy_bandwidth,
    greedy,
    mlx_lm_model,
    percentile,
    save_results,
    spread,
    use_cpu,
)

CONFIGS = {
    "a": "(a) quantized weights",
    "b": "(b) float32, reference BLAS",
    "c": "(c) float32 + OpenBLAS",
    "cN": "(c), OpenBLAS on every core",
    "mlxlm": "mlx-lm, float32 + OpenBLAS",
}
FIGURE_LABELS = {
    "a": "(a) quantized\nweights",
    "b": "(b) float32,\nreference BLAS",
    "c": "(c) float32\n+ OpenBLAS",
    "cN": "(c), OpenBLAS\nevery core",
    "mlxlm": "mlx-lm, float32\n+ OpenBLAS",
}
SLOW = ("a", "b")
SERVED = ("c", "cN")  # OpenBLAS one thread vs every core, also under serving contention
PROMPT_TEXT = (
    "The history of computing is a story of trade-offs between memory and arithmetic. "
    "Early machines stored programs on punched cards, and every instruction had to be "
    "fetched from slow storage before it could run. Caches, pipelines and vector units "
    "were each invented to keep the arithmetic busy while the data travelled. "
)


# ---------------------------------------------------------------- worker (one subprocess)


def prompt_ids(tokenizer: Any, n: int) -> list[int]:
    ids = tokenizer.encode(PROMPT_TEXT * (1 + 8 * n // len(PROMPT_TEXT)))
    if len(ids) < n:
        raise RuntimeError(f"prompt text too short for {n} tokens")
    return ids[:n]


def decode_bytes_per_token(params: dict[str, Any], vocab: int, tied: bool) -> int:
    """Weight bytes one decode step reads: every parameter once, except the embedding
    table, of which the lookup reads one row; a tied LM head then reads the whole table."""
    embed = sum(v.nbytes for k, v in params.items() if k.startswith("model.embed_tokens."))
    rest = sum(v.nbytes for v in params.values()) - embed
    return rest + embed // vocab + (embed if tied else 0)


def timed_tokens(stream: Any) -> tuple[list[float], list[int]]:
    """Drain a token stream; returns the time of each new token and the tokens."""
    stamps, tokens = [], []
    for token in stream:
        stamps.append(time.perf_counter())
        tokens.append(token)
    return stamps, tokens


def serve(model: Any, tokenizer: Any, n_requests: int, n_prompt: int,
          n_decode: int) -> dict[str, Any]:
    """``n_requests`` requests at once through the engine (defaults, prefix caching off):
    output tok/s, the median decode step and TTFT p50, wall-clock."""
    from tiny_llm import LLMEngine

    ids = prompt_ids(tokenizer, n_prompt + 7 * n_requests)
    prompts = [ids[7 * i : 7 * i + n_prompt] for i in range(n_requests)]
    engine = LLMEngine(model, tokenizer, max_num_seqs=n_requests, enable_prefix_caching=False,
                       max_model_len=-(-(n_prompt + n_decode) // 16) * 16)
    start = time.perf_counter()
    rids = [engine.add_request(p, greedy(n_decode)) for p in prompts]
    first: dict[str, float] = {}
    decode_steps, generated = [], 0
    while engine.has_unfinished_requests():
        computed = engine.stats()["num_prompt_tokens_computed"]
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if engine.stats()["num_prompt_tokens_computed"] == computed:
            decode_steps.append(now - t0)
        for out in outputs:
            generated += len(out.new_token_ids)
            if out.new_token_ids:
                first.setdefault(out.request_id, now - start)
    wall = time.perf_counter() - start
    if generated != n_requests * n_decode or len(first) != len(rids):
        raise RuntimeError(f"served {generated} tokens, expected {n_requests * n_decode}")
    return {
        "requests": n_requests,
        "prompt_tokens": n_prompt,
        "decode_tokens": n_decode,
        "wall_s": wall,
        "tok_s": generated / wall,
        "decode_step_ms": 1e3 * statistics.median(decode_steps),
        "ttft_p50_s": percentile(list(first.values()), 50),
    }


def worker(config: str, n_prompt: int, n_decode: int, n_serve: int) -> dict[str, Any]:
    from tiny_llm import load, openblas_loaded, stream_generate

    import mlx.core as mx
    from mlx.utils import tree_flatten

    t0 = time.perf_counter()
    model, tokenizer = load(dtype=mx.float32, dequantize=config != "a")
    load_s = time.perf_counter() - t0
    if config == "mlxlm":
        from mlx_lm.generate import generate_step

        model = mlx_lm_model(model)

        def run(prompt: list[int], n: int) -> Any:
            return (tok for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n))
    else:

        def run(prompt: list[int], n: int) -> Any:
            for out in stream_generate(model, tokenizer, prompt, greedy(n)):
                yield from out.new_token_ids

    prompt = prompt_ids(tokenizer, n_prompt)
    timed_tokens(run(prompt[:32], 4))  # warmup: first-call costs, thread pools, allocator
    start = time.perf_counter()
    stamps, tokens = timed_tokens(run(prompt, n_decode))
    if len(tokens) != n_decode:
        raise RuntimeError(f"{config}: generated {len(tokens)} tokens, expected {n_decode}")
    c = model.config if config != "mlxlm" else model.args
    params = dict(tree_flatten(model.parameters()))
    served = None
    if config in SERVED and n_serve:
        serve(model, tokenizer, 2, 16, 2)  # warmup: the engine's first steps
        served = serve(model, tokenizer, n_serve, max(32, n_prompt // 4),
                       max(8, n_decode // 4))
    return {
        "config": config,
        "openblas": openblas_loaded(),
        "openblas_threads": openblas_threads(),
        "load_s": load_s,
        "prefill_s": stamps[0] - start,
        "prefill_tok_s": n_prompt / (stamps[0] - start),
        "decode_tok_s": (n_decode - 1) / (stamps[-1] - stamps[0]),
        "bytes_per_token": decode_bytes_per_token(params, c.vocab_size, c.tie_word_embeddings),
        "tokens": tokens,
        "serve": served,
    }


# ---------------------------------------------------------------- orchestrator


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("TINY_LLM_NO_OPENBLAS", None)
    env.pop("OPENBLAS_NUM_THREADS", None)
    if config == "b":
        env["TINY_LLM_NO_OPENBLAS"] = "1"
    if config == "cN":
        env["OPENBLAS_NUM_THREADS"] = str(os.cpu_count())
    cmd = [sys.executable, os.path.abspath(__file__), "--config", config,
           "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
           "--serve-requests", str(args.serve_requests)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"configuration {config} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def leading_matches(tokens: list[int], reference: list[int]) -> int:
    n = 0
    for x, y in zip(tokens, reference, strict=False):
        if x != y:
            break
        n += 1
    return n


def summarize(rounds: list[dict[str, Any]], bandwidths: list[float]) -> dict[str, Any]:
    bandwidth = statistics.median(bandwidths)
    summary: dict[str, Any] = {}
    for config in CONFIGS:
        runs = [r[config] for r in rounds if config in r]
        if not runs:
            continue
        paired = [(r[config], r["c"]) for r in rounds if config in r and "c" in r]
        bytes_per_token = runs[0]["bytes_per_token"]
        decode = statistics.median(r["decode_tok_s"] for r in runs)
        bound = bandwidth / bytes_per_token
        ratio = {  # median over rounds of the ratio measured within the round
            k: statistics.median(x[k] / c[k] for x, c in paired) if paired else None
            for k in ("prefill_tok_s", "decode_tok_s")
        }
        summary[config] = {
            "label": CONFIGS[config],
            "runs": len(runs),
            "openblas": runs[0]["openblas"],
            "openblas_threads": runs[0]["openblas_threads"],
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "prefill_tok_s_all": [r["prefill_tok_s"] for r in runs],
            "decode_tok_s": decode,
            "decode_tok_s_all": [r["decode_tok_s"] for r in runs],
            "bytes_per_token": bytes_per_token,
            "decode_bound_tok_s": bound,
            "decode_vs_bound": decode / bound,
            "prefill_vs_c": ratio["prefill_tok_s"],
            "decode_vs_c": ratio["decode_tok_s"],
            "greedy_tokens_equal_to_c": min(
                (leading_matches(x["tokens"], c["tokens"]) for x, c in paired), default=None
            ),
            "prefill_tok_s_spread": spread([r["prefill_tok_s"] for r in runs]),
            "decode_tok_s_spread": spread([r["decode_tok_s"] for r in runs]),
        }
        if runs[0].get("serve"):
            summary[config]["serve"] = {
                k: spread([r["serve"][k] for r in runs])
                for k in ("tok_s", "decode_step_ms", "ttft_p50_s")
            }
    return summary


THREAD_ROWS = (  # (label, where, key)
    ("single stream: prefill tok/s", None, "prefill_tok_s"),
    ("single stream: decode tok/s", None, "decode_tok_s"),
    ("serving: output tok/s", "serve", "tok_s"),
    ("serving: decode step ms", "serve", "decode_step_ms"),
    ("serving: TTFT p50 s", "serve", "ttft_p50_s"),
)


def threads_table(rounds: list[dict[str, Any]], data: dict[str, Any]) -> Table | None:
    """OpenBLAS on one thread (c) vs every core (cN), alone and under serving contention:
    medians, and the median of the per-round ratios cN / c."""
    paired = [(r["c"], r["cN"]) for r in rounds if "c" in r and "cN" in r]
    if not paired:
        return None

    def value(run: dict[str, Any], where: str | None, key: str) -> float | None:
        part = run if where is None else run.get(where)
        return None if part is None else part[key]

    rows = []
    for label, where, key in THREAD_ROWS:
        pairs = [(value(c, where, key), value(n, where, key)) for c, n in paired]
        if any(a is None or b is None for a, b in pairs):
            continue
        one = statistics.median(a for a, _ in pairs)
        every = statistics.median(b for _, b in pairs)
        rows.append([label, one, every, statistics.median(b / a for a, b in pairs)])
    threads = paired[0][1]["openblas_threads"]
    serve = paired[0][0].get("serve") or {}
    return Table(
        title="OpenBLAS on one thread (c) vs every core (cN): one stream, and serving "
        f"{serve.get('requests', '–')} requests at once",
        headers=["measure", "OpenBLAS 1 thread", f"OpenBLAS {threads} threads",
                 f"{threads} threads / 1 thread"],
        rows=rows,
        formats=["", ".2f", ".2f", ".2f"],
        note=(
            "Single stream: the batch-1 request of the table above. Serving: "
            f"{serve.get('requests')} requests at once through LLMEngine (paged KV, tiled "
            f"kernel on its worker threads, chunked prefill, prefix caching off), prompts of "
            f"{serve.get('prompt_tokens')} tokens, {serve.get('decode_tokens')} new tokens "
            "each, greedy; output tok/s = new tokens / wall time; decode step: median over "
            "steps that compute no prompt token. Same float32 weights, fresh process per "
            f"configuration; medians over {len(paired)} round(s), the ratio the median of "
            "per-round ratios (above 1: every core is better for tok/s, worse for ms and s)."
        ),
    )


def make_table(summary: dict[str, Any], data: dict[str, Any]) -> Table:
    n = data["settings"]["decode_tokens"]
    rows = [
        [s["label"], s["bytes_per_token"] / 1e6, s["prefill_tok_s"], s["decode_tok_s"],
         s["decode_vs_bound"], s["prefill_vs_c"], s["decode_vs_c"],
         f"{s['greedy_tokens_equal_to_c']}/{n}"]
        for s in summary.values()
    ]
    settings = data["settings"]
    note = (
        f"Batch 1, greedy, {settings['prompt_tokens']}-token prompt in one forward, then "
        f"{n} new tokens; float32 activations; medians over {data['rounds']} interleaved "
        f"rounds ((a), (b): {data['slow_rounds']}). Ratios vs (c) are medians of ratios "
        f"measured within a round. Decode bound = weight bytes read per token / copy "
        f"bandwidth ({data['copy_bandwidth_GBps']:.1f} GB/s, bytes read + written by a "
        f"256 MB numpy copy). Ours: `tiny_llm.engine.generate.stream_generate`; mlx-lm: "
        f"`mlx_lm.generate.generate_step` with `llama.Model` on the same float32 arrays. "
        f"Last column: leading greedy tokens identical to (c)'s. 1-minute load average "
        f"after each round: {', '.join(f'{x:.1f}' for x in data['load_avg_1m_after_each_round'])} "
        f"on {os.cpu_count()} cores."
    )
    return Table(
        title="SmolLM2-135M on this CPU: batch-1 prefill and decode",
        headers=["config", "MB read / token", "prefill tok/s", "decode tok/s",
                 "decode vs bound", "prefill vs (c)", "decode vs (c)", "greedy = (c)"],
        rows=rows,
        formats=["", ".0f", ".1f", ".2f", ".2f", ".3g", ".3g", ""],
        note=note,
    )


def make_figure(summary: dict[str, Any], n_prompt: int) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [FIGURE_LABELS[k] for k in summary]
    x = np.arange(len(labels))
    palette = {"a": "tab:gray", "b": "tab:red", "c": "tab:blue", "cN": "tab:cyan",
               "mlxlm": "tab:green"}
    colors = [palette[k] for k in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    prefill = [s["prefill_tok_s"] for s in summary.values()]
    ax1.bar(x, prefill, color=colors)
    ax1.set_title(f"prefill ({n_prompt}-token prompt), tok/s")
    decode = [s["decode_tok_s"] for s in summary.values()]
    ax2.bar(x, decode, color=colors)
    bounds = [s["decode_bound_tok_s"] for s in summary.values()]
    ax2.hlines(bounds, x - 0.4, x + 0.4, colors="black", linestyles="dashed",
               label="memory-bandwidth bound")
    ax2.set_title("decode, tok/s")
    ax2.legend(loc="upper right", fontsize=8)
    for ax, values, extra in ((ax1, prefill, []), (ax2, decode, bounds)):
        ax.set_yscale("log")
        ax.set_ylim(min(values + extra) / 2, max(values + extra) * 2)
        ax.set_xticks(x, labels, fontsize=8)
        for xi, v in zip(x, values, strict=True):
            ax.annotate(f"{v:.3g}", (xi, v), ha="center", va="bottom", fontsize=8)
    for ax, key in ((ax1, "prefill_tok_s_all"), (ax2, "decode_tok_s_all")):
        for xi, s in zip(x, summary.values(), strict=True):  # every run, to show the noise
            ax.plot([xi + 0.25] * len(s[key]), s[key], "k.", markersize=4)
    fig.suptitle("SmolLM2-135M, batch 1, float32 activations, CPU "
                 "(log scales; bars: medians, dots: runs)")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--slow-rounds", type=int, default=None,
                    help="rounds that include the slow configurations (a) and (b) "
                    "(default 1; quick: 0)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="subset, e.g. c,mlxlm")
    ap.add_argument("--out", help="results name (default bench_model, or bench_model_quick)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 512 (quick: 64)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="default 128 (quick: 8)")
    ap.add_argument("--serve-requests", type=int, default=None,
                    help="requests served at once by (c) and (cN) (default 8; quick: 4; 0: none)")
    ap.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args()
    use_cpu()  # the CPU's formats and OpenBLAS configurations
    quick = args.quick
    args.prompt_tokens = args.prompt_tokens or (64 if quick else 512)
    args.decode_tokens = args.decode_tokens or (8 if quick else 128)
    if args.serve_requests is None:
        args.serve_requests = 4 if quick else 8
    if args.config:
        print(json.dumps(worker(args.config, args.prompt_tokens, args.decode_tokens,
                                args.serve_requests)))
        return
    if quick and "--rounds" not in sys.argv:
        args.rounds = 1
    if args.slow_rounds is None:
        args.slow_rounds = 0 if quick else 1
    configs = args.configs.split(",")
    slow_rounds = min(args.rounds, args.slow_rounds)

    t0 = time.perf_counter()
    rounds: list[dict[str, Any]] = []
    bandwidths, loads = [], []  # loads: 1-minute load average after each round
    for r in range(args.rounds):
        results: dict[str, Any] = {}
        order = configs if r % 2 == 0 else configs[::-1]
        for config in order:
            if config in SLOW and r >= slow_rounds:
                continue
            results[config] = run_config(config, args)
            served = results[config]["serve"]
            print(f"[{time.perf_counter() - t0:6.0f}s] round {r + 1}: {config:5s} "
                  f"prefill {results[config]['prefill_tok_s']:7.1f} tok/s, "
                  f"decode {results[config]['decode_tok_s']:6.2f} tok/s"
                  + (f", serving {served['tok_s']:6.1f} tok/s" if served else ""), flush=True)
        bandwidths.append(copy_bandwidth())
        loads.append(os.getloadavg()[0])
        rounds.append(results)

    summary = summarize(rounds, bandwidths)
    data = {
        "settings": {"model": "SmolLM2-135M-Instruct.Q4_1.gguf (default_model_path())",
                     "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                     "serve_requests": args.serve_requests,
                     "batch": 1, "sampling": "greedy", "activations": "float32"},
        "rounds": args.rounds,
        "slow_rounds": slow_rounds,
        "copy_bandwidth_GBps": statistics.median(bandwidths) / 1e9,
        "copy_bandwidth_GBps_all": [b / 1e9 for b in bandwidths],
        "load_avg_1m_after_each_round": loads,
        "configs": summary,
        "per_round": [{k: {f: v for f, v in x.items() if f != "tokens"} for k, x in r.items()}
                      for r in rounds],
        "wall_s": time.perf_counter() - t0,
    }
    tables = [make_table(summary, data)]
    threads = threads_table(rounds, data)
    if threads is not None:
        tables.append(threads)
    name = args.out or ("bench_model_quick" if quick else "bench_model")
    save_results(name, data, tables, make_figure(summary, args.prompt_tokens),
                 rounds=args.rounds)


if __name__ == "__main__":
    main()
