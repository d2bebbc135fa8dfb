"""Serving speed on the CPU: the standard serving workload through the engine with and
without the extension's CPU kernels, next to mlx-lm's ``batch_generate`` and the compute
bound of the workload.

The workload: 32 requests of seeded random token ids, prompts of 32-512 tokens and
32-128 output tokens each (greedy, ``ignore_eos``), all added at once. Five ways to serve
it, each alone in turn, the order rotated every round (``--rounds``, default 3; medians):

- ``MLX ops``: the default engine with ``cpu_kernels=False``: every matmul by MLX's
  matmul (OpenBLAS on one thread), RoPE by ``mx.fast.rope``, what the engine did before the
  CPU kernels;
- ``kernels``: the default engine (``tiny_llm/kernels/cpu_kernels.py``): decode rows by the
  extension's decode matmul, prefill rows by OpenBLAS split over the worker pool, RoPE by
  the extension's one op;
- ``kernels, 16 slots``: the same with ``max_num_seqs=16``, the default before it became
  32 (as many requests at once as mlx-lm's ``batch_generate`` runs by default);
- ``as stored, int8``: the default engine on the GGUF's weights as stored (4-bit layers,
  an 8-bit embedding: ``--quantized``) with ``int8_activations=True``
  (``--int8-activations``). A different model in its numbers, so its tokens are not
  float32's;
- ``mlx-lm``: ``mlx_lm.generate.batch_generate`` with its defaults, on mlx-lm's Llama class
  holding the very same float32 arrays, through the same OpenBLAS.

Reported: wall time from the first step to the last token, output tok/s, and for the
engines the split between steps that prefill (any prompt token in the step) and decode-only
steps (count, seconds, tokens per second, rows per step). The compute bound is the
workload's matmul flops at the best float32 GEMM rate measured in the run (a 1024^3
product by OpenBLAS split over every core): 2 flops per weight of every linear layer for
each prompt and output token, and of the vocabulary projection for each output token (the
only rows whose logits are needed); attention's few flops are left out. Greedy tokens are
compared request by request.

    python benches/bench_cpu_speed.py          # about 12 minutes on 2 cores
    python benches/bench_cpu_speed.py --quick  # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from tiny_llm import LLMEngine

import mlx.core as mx
from bench_cpu_decode import gemm_rate, matmul_params, stored_model
from bench_week3_day5 import StubTokenizer
from common import (
    Table,
    bench_parser,
    goals_table,
    greedy,
    load_model,
    mlx_lm_model,
    save_results,
    spread,
    use_cpu,
)

NAME = "bench_cpu_speed"
# label -> engine options beside the defaults; "kernels, 16 slots" is the default engine
# as it was with max_num_seqs = 16, to show what the 32 slots of today's default buy.
ENGINES: dict[str, dict[str, Any]] = {
    "MLX ops": {"cpu_kernels": False},
    "kernels, 16 slots": {"max_num_seqs": 16},
    "kernels": {},
    "as stored, int8": {"int8_activations": True},
}
STORED = {"as stored, int8"}  # these labels serve the weights as stored
MLX_LM = "mlx-lm batch_generate"


def workload(quick: bool, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    n, prompt, output = (6, (8, 32), (4, 8)) if quick else (32, (32, 512), (32, 128))
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))]
               for _ in range(n)]
    return prompts, [rng.randint(*output) for _ in range(n)]


def serve_engine(model: Any, tokenizer: Any, prompts: list[list[int]], outputs: list[int],
                 **options: Any) -> dict[str, Any]:
    engine = LLMEngine(model, tokenizer, **options)
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(n))
           for p, n in zip(prompts, outputs, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    sched = engine.scheduler
    steps = []
    start = time.perf_counter()
    computed = engine.core.counters["num_prompt_tokens_computed"]
    while engine.has_unfinished_requests():
        rows = len(sched.running)
        t0 = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        elapsed = time.perf_counter() - t0
        # A step prefills if it computed prompt tokens (a request waiting for a free slot
        # does not make a step of decodes a prefill step).
        prefill = engine.core.counters["num_prompt_tokens_computed"] > computed
        computed = engine.core.counters["num_prompt_tokens_computed"]
        steps.append((prefill, elapsed, rows))
    wall = time.perf_counter() - start
    prefill = [s for s in steps if s[0]]
    decode = [s for s in steps if not s[0]]
    generated = sum(map(len, tokens.values()))
    return dict(
        wall_s=wall, generated=generated, tok_per_s=generated / wall,
        prefill_steps=len(prefill), prefill_s=sum(s[1] for s in prefill),
        decode_steps=len(decode), decode_s=sum(s[1] for s in decode),
        decode_step_ms=1e3 * statistics.fmean(s[1] for s in decode) if decode else None,
        decode_rows=statistics.fmean(s[2] for s in decode) if decode else None,
        tokens=[tokens[i] for i in ids],
    )


def serve_mlx_lm(lm: Any, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    from mlx_lm.generate import batch_generate

    start = time.perf_counter()
    resp = batch_generate(lm, StubTokenizer(), prompts, max_tokens=outputs,
                          return_token_ids=True)
    wall = time.perf_counter() - start
    generated = sum(map(len, resp.token_ids))
    return dict(wall_s=wall, generated=generated, tok_per_s=generated / wall,
                prompt_tps=resp.stats.prompt_tps, generation_tps=resp.stats.generation_tps,
                tokens=[list(t) for t in resp.token_ids])


def median_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def make_tables(res: dict[str, Any], data: dict[str, Any]) -> list[Table]:
    mlx_lm = res[MLX_LM]
    rows = []
    for label in [*ENGINES, MLX_LM]:
        r = res[label]
        rows.append([label, r["wall_s"], r["tok_per_s"], r["tok_per_s"] / mlx_lm["tok_per_s"],
                     r["wall_s"] / data["compute_bound_s"], r["same_tokens"]])
    serving = Table(
        title=f"Serving workload on the CPU, {data['model']}: output tok/s and the compute bound",
        headers=["", "wall s", "output tok/s", "x mlx-lm", "wall / compute bound",
                 "requests with MLX ops' tokens"],
        rows=rows, formats=["", ".1f", ".1f", ".2f", ".2f", ""],
        note=(f"{data['requests']} requests at once, {data['prompt_tokens']} prompt and "
              f"{data['output_tokens']} output tokens (greedy, ignore_eos); default engine; "
              "as stored, int8: the GGUF's 4- and 8-bit weights, int8 activations. "
              f"Compute bound: the workload's {data['matmul_TFLOP']:.2f} TFLOP of matmuls "
              f"(every token through the linear layers, output tokens through the vocabulary "
              f"projection) at {data['gemm_all_cores_GFLOPs']:.1f} GFLOP/s (a 1024^3 float32 "
              f"product, OpenBLAS split over every core) = {data['compute_bound_s']:.1f} s. "
              f"Medians of {data['rounds']} rounds; x mlx-lm is the ratio of medians."),
    )
    phases = Table(
        title="Where the engines' time goes: steps with prefill and decode-only steps",
        headers=["", "prefill steps", "prefill s", "prompt tok/s", "decode-only steps",
                 "decode s", "ms per decode step", "rows per decode step"],
        rows=[[label, res[label]["prefill_steps"], res[label]["prefill_s"],
               data["prompt_tokens"] / res[label]["prefill_s"], res[label]["decode_steps"],
               res[label]["decode_s"], res[label]["decode_step_ms"], res[label]["decode_rows"]]
              for label in ENGINES],
        formats=["", ".0f", ".1f", ".0f", ".0f", ".1f", ".1f", ".1f"],
        note=("A step with prefill computes prompt tokens (and the decodes running beside "
              "them); prompt tok/s divides all prompt tokens by the time of those steps. Rows "
              "per decode step: requests running as a decode-only step starts. "
              f"mlx-lm's own counters: prompt {mlx_lm['prompt_tps']:.0f} tok/s, generation "
              f"{mlx_lm['generation_tps']:.1f} tok/s."),
    )
    kernels, x_mlx_lm = res["kernels"], data["kernels_x_mlx_lm"]
    wall_ratio = kernels["wall_s"] / data["compute_bound_s"]
    goals = goals_table("The serving goals, kernels (the default engine)", [
        ("output tok/s at 5x mlx-lm's or more", f"{x_mlx_lm:.2f}x", x_mlx_lm >= 5),
        ("wall time within 2x the compute bound", f"{wall_ratio:.2f}x", wall_ratio <= 2),
    ])
    return [serving, phases, goals]


def make_figure(res: dict[str, Any], data: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [*ENGINES, MLX_LM]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(labels, [res[k]["tok_per_s"] for k in labels],
            color=[f"C{i}" for i in range(len(labels))])
    ax1.set_ylabel("output tok/s")
    ax1.set_title("serving workload, output tok/s")
    engines = list(ENGINES)
    prefill = [res[k]["prefill_s"] for k in engines]
    decode = [res[k]["decode_s"] for k in engines]
    ax2.bar(engines, prefill, label="steps with prefill")
    ax2.bar(engines, decode, bottom=prefill, label="decode-only steps")
    ax2.axhline(data["compute_bound_s"], color="k", linestyle=":", label="compute bound")
    ax2.axhline(res[MLX_LM]["wall_s"], color=f"C{len(ENGINES)}", linestyle="--",
                label="mlx-lm wall")
    ax2.set_ylabel("seconds")
    ax2.set_title("engine wall time by step kind")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{data['model']}, CPU, {data['requests']} requests")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = bench_parser(__doc__)
    args = ap.parse_args()
    use_cpu()
    if args.quick and "--rounds" not in sys.argv:
        args.rounds = 1
    model, tokenizer, model_name = load_model(args.quick)
    lm = mlx_lm_model(model)
    prompts, outputs = workload(args.quick, model.config.vocab_size)
    stored = stored_model(args.quick)
    models = {label: stored if label in STORED else model for label in ENGINES}
    for label, options in ENGINES.items():  # warmup
        serve_engine(models[label], tokenizer, prompts[:2], [2, 2], **options)
    labels = [*ENGINES, MLX_LM]
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in labels}
    rates = []
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            if label == MLX_LM:
                out = serve_mlx_lm(lm, prompts, outputs)
            else:
                out = serve_engine(models[label], tokenizer, prompts, outputs,
                                   **ENGINES[label])
            rounds[label].append(out)
            print(f"[{time.perf_counter() - t0:5.0f}s] round {r + 1}: {label:24s} "
                  f"{out['wall_s']:6.1f} s, {out['tok_per_s']:.1f} tok/s", flush=True)
        rates.append(gemm_rate(split=True))
    rate = statistics.median(rates)
    reference = rounds["MLX ops"][0]["tokens"]
    res: dict[str, Any] = {}
    for label in labels:
        keys = {k for k, v in rounds[label][0].items() if isinstance(v, int | float)}
        res[label] = {k: median_of(rounds[label], k) for k in keys}
        res[label]["tok_per_s_rounds"] = spread([x["tok_per_s"] for x in rounds[label]])
        res[label]["same_tokens"] = sum(
            a == b for a, b in zip(rounds[label][0]["tokens"], reference, strict=True))
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(outputs)
    head = model.config.vocab_size * model.config.hidden_size
    flops = 2 * ((matmul_params(model) - head) * (prompt_tokens + output_tokens)
                 + head * output_tokens)
    data = {
        "model": model_name, "rounds": args.rounds, "requests": len(prompts),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "matmul_TFLOP": flops / 1e12, "gemm_all_cores_GFLOPs": rate / 1e9,
        "compute_bound_s": flops / rate, "results": res,
        "kernels_x_mlx_ops": res["kernels"]["tok_per_s"] / res["MLX ops"]["tok_per_s"],
        "kernels_x_mlx_lm": res["kernels"]["tok_per_s"] / res[MLX_LM]["tok_per_s"],
        "wall_s": time.perf_counter() - t0,
    }
    mx.clear_cache()
    save_results(NAME + ("_quick" if args.quick else ""), data, make_tables(res, data),
                 make_figure(res, data), rounds=args.rounds)


if __name__ == "__main__":
    main()
