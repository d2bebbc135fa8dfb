"""Decode speed against batch size on the CPU, next to the machine's memory-bandwidth and
compute bounds: the model's ops in MLX against the extension's CPU kernels.

For each batch size ``B`` (1, 2, 4, ..., 64; ``--quick``: 1, 2, 4 on the tiny model) and
each of two engines, one engine (the defaults: paged KV, tiled kernel, chunked prefill;
prefix caching off) serves ``B`` requests of 16 random prompt tokens at once,
``max_num_seqs=B``:

- ``MLX ops``: ``cpu_kernels=False``, every matmul by MLX's matmul (OpenBLAS on one
  thread), RoPE by ``mx.fast.rope`` (what the engine did before the CPU kernels);
- ``kernels``: the default, ``cpu_kernels=True`` (``tiny_llm/kernels/cpu_kernels.py``): decode rows
  by the extension's decode matmul on the worker pool, RoPE by its one-op rope;
- ``as stored``: the kernels on the file's weights as they are stored (``load(dequantize=
  False)``, ``--quantized`` on the command line: 4-bit layers, an 8-bit embedding; with
  ``--quick`` the tiny model quantized the same way), decode rows by the extension's
  quantized matmul. Its bytes per step are those of the packed weights.
- ``int8``: as stored, with ``int8_activations=True`` (``--int8-activations``): the decode
  rows rounded to int8 per 32 values and multiplied by the packed weights as integers.

Once every request is decoding, ``--steps`` (16) decode steps are timed one by one
(``engine.step()``, wall clock); the median is the step time. Right after, the model's
matmuls alone at ``B`` rows, as each engine runs them (``GemmProbe``, the median of 5).

Bounds, measured in the same run:

- **memory**: a decode step reads every weight once (``bench_model``'s bytes per token,
  538 MB in float32 for SmolLM2-135M) whatever ``B`` is; divided by the copy bandwidth (a
  256 MB numpy copy, bytes read + written) that is the shortest a step can be. K/V reads
  are left out, so the bound is optimistic at large batches: 45 KiB per token of context
  in float32 and 17-33 tokens per request while timed, on average about 14% of the
  weights' bytes at batch 64 and 2% at batch 8.
- **compute**: ``2 x (weights of the matmuls) x B`` flops per step at the best float32
  GEMM rate measured here: one 1024 x 1024 x 1024 product by OpenBLAS split over every
  core (the extension's ``linear(..., blas=True)``). The one-thread rate is reported too.

Reported per ``B``: ms/step of the three engines, the kernels' speedup over MLX ops,
output tok/s (``B`` / step time), the GEMMs-alone times, the weight bytes streamed per
second during the kernels' step (bytes per step / step time) and that as a fraction of the
copy bandwidth, and the kernels' step time over each bound; then the as-stored engine's
step against the float32 kernels' and against its own memory bound, and the int8
engine's step against the float32 kernels'. ``--rounds`` rounds
(default 3), batch sizes and engines in alternating order; medians.

    python benches/bench_cpu_decode.py          # about 4 minutes on 2 cores
    python benches/bench_cpu_decode.py --quick  # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from tiny_llm import LLMEngine, openblas_threads

import mlx.core as mx
import numpy as np
from bench_model import decode_bytes_per_token
from common import (
    GemmProbe,
    Table,
    bench_parser,
    copy_bandwidth,
    goals_table,
    greedy,
    load_model,
    save_results,
    use_cpu,
)
from mlx.utils import tree_flatten

NAME = "bench_cpu_decode"
PROMPT_TOKENS = 16


def gemm_rate(n: int = 1024, repeats: int = 5, split: bool = False) -> float:
    """float32 flops per second of one n x n x n product (median of repeats), by MLX's
    matmul or (``split``) by the extension's BLAS split over every core."""
    from tiny_llm import reference_extension

    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    ext = reference_extension()
    product = (lambda: ext.linear(a, b, blas=True)) if split else (lambda: a @ b.T)
    mx.eval(a, b, product())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(product())
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def decode_steps(model: Any, tokenizer: Any, batch: int, steps: int, seed: int,
                 cpu_kernels: bool, int8: bool = False) -> list[float]:
    """Seconds of ``steps`` decode steps with ``batch`` requests decoding."""
    rng = random.Random(seed)
    engine = LLMEngine(model, tokenizer, max_num_seqs=batch, enable_prefix_caching=False,
                       max_num_batched_tokens=max(512, batch), max_model_len=256,
                       cpu_kernels=cpu_kernels, int8_activations=int8)
    for _ in range(batch):
        prompt = [rng.randrange(100, 10000) for _ in range(PROMPT_TOKENS)]
        engine.add_request({"prompt_token_ids": prompt}, greedy(steps + 8))
    sched = engine.scheduler
    while sched.waiting or any(r.num_tokens == len(r.prompt_token_ids) for r in sched.running):
        engine.step()  # until every request has its first token: from now on, decodes only
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"batch {batch}: {len(engine.scheduler.running)} requests running")
    return times


def matmul_params(model: Any) -> int:
    """Weights that take part in a matmul per token (the linear layers and the LM head)."""
    import mlx.nn as nn

    linear = sum(m.weight.size for _, m in model.named_modules() if isinstance(m, nn.Linear))
    head = model.model.embed_tokens.weight.size if model.config.tie_word_embeddings else 0
    return linear + head


# label -> (cpu_kernels, the weights as stored rather than float32, int8 activations)
ENGINES = {"MLX ops": (False, False, False), "kernels": (True, False, False),
           "as stored": (True, True, False), "int8": (True, True, True)}


def stored_model(quick: bool) -> Any:
    """The default GGUF's weights as stored, or the tiny random model quantized as it is."""
    from tiny_llm import load

    import mlx.nn as nn

    if not quick:
        return load(None, dequantize=False)[0]
    model = load_model(True)[0]
    nn.quantize(model, class_predicate=lambda path, module: hasattr(module, "to_quantized")
                and {"group_size": 32, "bits": 8 if "embed" in path else 4})
    return model


def make_table(rows: list[dict[str, Any]], data: dict[str, Any]) -> Table:
    return Table(
        title=f"Decode against batch size, {data['model']}: MLX ops against the CPU kernels, "
              "and the bounds; the kernels on the weights as stored",
        headers=["batch", "ms/step MLX ops", "ms/step kernels", "kernels speedup",
                 "kernels tok/s", "GEMMs alone ms MLX", "GEMMs alone ms kernels",
                 "kernels weights GB/s", "of copy bandwidth", "step / memory bound",
                 "step / compute bound", "ms/step as stored", "as stored / kernels",
                 "as stored / its memory bound", "ms/step int8", "int8 / kernels"],
        rows=[[r["batch"], r["mlx_step_ms"], r["step_ms"], r["speedup"], r["tok_s"],
               r["mlx_gemm_ms"], r["gemm_ms"], r["weights_GBps"], r["of_bandwidth"],
               r["vs_memory_bound"], r["vs_compute_bound"], r["stored_step_ms"],
               r["stored_vs_kernels"], r["stored_vs_memory_bound"], r["int8_step_ms"],
               r["int8_vs_kernels"]] for r in rows],
        formats=["", ".1f", ".1f", ".2f", ".1f", ".1f", ".1f", ".1f", ".2f", ".2f", ".2f",
                 ".1f", ".2f", ".2f", ".1f", ".2f"],
        note=(
            f"Engine defaults (paged KV, tiled kernel, prefix caching off), max_num_seqs = "
            f"batch, {PROMPT_TOKENS}-token prompts; ms/step: median of {data['steps']} decode "
            f"steps, then of {data['rounds']} rounds. MLX ops: cpu_kernels=False; kernels: "
            f"the default. Weights read per step: {data['bytes_per_step'] / 1e6:.0f} MB; copy "
            f"bandwidth {data['copy_bandwidth_GBps']:.1f} GB/s, so the memory bound is "
            f"{data['memory_bound_ms']:.1f} ms/step at any batch. Compute bound: "
            f"{data['matmul_params'] / 1e6:.0f}M matmul weights x 2 flops x batch at "
            f"{data['gemm_all_cores_GFLOPs']:.1f} GFLOP/s (one 1024^3 float32 product, OpenBLAS "
            f"split over every core; on one thread: {data['gemm_GFLOPs']:.1f}). GEMMs alone: "
            "the step's matmuls at batch rows on random inputs, as each engine runs them. "
            "As stored: the kernels on the packed weights, "
            f"{data['stored_bytes_per_step'] / 1e6:.0f} MB a step, so a memory bound of "
            f"{data['stored_memory_bound_ms']:.1f} ms. Int8: as stored, with "
            "int8_activations=True."
        ),
    )


def make_goals(rows: list[dict[str, Any]], data: dict[str, Any]) -> Table:
    one, last = rows[0], rows[-1]
    of_bound = data["memory_bound_ms"] / one["step_ms"]
    growing = all(b["tok_s"] > a["tok_s"] for a, b in zip(rows, rows[1:], strict=False))
    return goals_table("The decode goals, kernels (the default engine)", [
        (f"batch-{one['batch']} decode at 70% of the memory bound or more",
         f"{of_bound:.0%} ({one['step_ms']:.1f} ms against {data['memory_bound_ms']:.1f} ms)",
         of_bound >= 0.7),
        ("tok/s grows with every doubling of the batch",
         f"{one['tok_s']:.1f} to {last['tok_s']:.1f} tok/s from batch {one['batch']} to "
         f"{last['batch']}", growing),
        (f"at batch {last['batch']}: the step at the compute bound",
         f"{last['vs_compute_bound']:.2f}x the bound", last["vs_compute_bound"] <= 1.0),
    ], note="The memory bound: the weights once at copy bandwidth; the compute bound: the "
            "matmuls' flops at one large OpenBLAS product's rate split over every core.")


def make_figure(rows: list[dict[str, Any]], data: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = np.array([r["batch"] for r in rows])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(b, [r["batch"] / r["mlx_step_ms"] * 1e3 for r in rows], "o-", label="MLX ops")
    ax1.plot(b, [r["tok_s"] for r in rows], "o-", label="kernels")
    ax1.plot(b, [r["batch"] / r["stored_step_ms"] * 1e3 for r in rows], "o-",
             label="kernels, as stored")
    ax1.plot(b, [r["batch"] / r["int8_step_ms"] * 1e3 for r in rows], "o-",
             label="as stored, int8 activations")
    ax1.plot(b, b / (data["memory_bound_ms"] / 1e3), "k--", label="memory bound")
    compute_s = 2 * data["matmul_params"] / (data["gemm_all_cores_GFLOPs"] * 1e9)
    ax1.plot(b, np.full(len(b), 1 / compute_s), "k:", label="compute bound")
    ax1.set_title("decode output tok/s")
    ax2.plot(b, [r["mlx_step_ms"] for r in rows], "o-", label="step, MLX ops")
    ax2.plot(b, [r["step_ms"] for r in rows], "o-", label="step, kernels")
    ax2.plot(b, [r["stored_step_ms"] for r in rows], "o-", label="step, as stored")
    ax2.plot(b, [r["int8_step_ms"] for r in rows], "o-", label="step, int8")
    ax2.plot(b, [r["mlx_gemm_ms"] for r in rows], "s--", label="GEMMs alone, MLX")
    ax2.plot(b, [r["gemm_ms"] for r in rows], "s--", label="GEMMs alone, kernels")
    ax2.axhline(data["memory_bound_ms"], color="k", linestyle="--", label="memory bound")
    ax2.set_title("ms per decode step")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests decoding)")
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['model']}, CPU")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    args = ap.parse_args()
    use_cpu()
    if args.quick and "--rounds" not in sys.argv:
        args.rounds = 1
    batches = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    model, tokenizer, model_name = load_model(args.quick)
    params = dict(tree_flatten(model.parameters()))
    c = model.config
    bytes_per_step = decode_bytes_per_token(params, c.vocab_size, c.tie_word_embeddings)
    stored = stored_model(args.quick)
    stored_bytes = decode_bytes_per_token(dict(tree_flatten(stored.parameters())),
                                          c.vocab_size, c.tie_word_embeddings)
    models = {label: stored if packed else model for label, (_, packed, _) in ENGINES.items()}
    probe = GemmProbe(model)
    for label, (cpu_kernels, _, int8) in ENGINES.items():  # warmup: first calls, thread pools
        decode_steps(models[label], tokenizer, 2, 2, seed=0, cpu_kernels=cpu_kernels, int8=int8)
    t0 = time.perf_counter()
    runs = {(b, e): {"step": [], "gemm": []} for b in batches for e in ENGINES}
    bandwidths, rates, split_rates = [], [], []
    for r in range(args.rounds):
        for batch in batches if r % 2 == 0 else batches[::-1]:
            for label in ENGINES if (r + batch) % 2 == 0 else list(ENGINES)[::-1]:
                kernels, packed, int8 = ENGINES[label]
                run = runs[batch, label]
                run["step"].append(statistics.median(decode_steps(
                    models[label], tokenizer, batch, args.steps, seed=r, cpu_kernels=kernels,
                    int8=int8)))
                if not packed:  # the probe's random weights are float32
                    run["gemm"].append(statistics.median(
                        probe.time(batch, batch, batch if kernels else None) for _ in range(5)))
                print(f"[{time.perf_counter() - t0:5.0f}s] round {r + 1}: batch {batch:3d} "
                      f"{label:9s} {1e3 * run['step'][-1]:7.1f} ms/step", flush=True)
        bandwidths.append(copy_bandwidth())
        rates.append(gemm_rate())
        split_rates.append(gemm_rate(split=True))
    bandwidth, rate = statistics.median(bandwidths), statistics.median(rates)
    split_rate = statistics.median(split_rates)
    memory_bound = bytes_per_step / bandwidth
    flops_per_row = 2 * matmul_params(model)
    rows = []
    for batch in batches:
        step = statistics.median(runs[batch, "kernels"]["step"])
        mlx_step = statistics.median(runs[batch, "MLX ops"]["step"])
        stored_step = statistics.median(runs[batch, "as stored"]["step"])
        int8_step = statistics.median(runs[batch, "int8"]["step"])
        rows.append(dict(
            batch=batch, step_ms=1e3 * step, mlx_step_ms=1e3 * mlx_step,
            speedup=mlx_step / step, tok_s=batch / step,
            gemm_ms=1e3 * statistics.median(runs[batch, "kernels"]["gemm"]),
            mlx_gemm_ms=1e3 * statistics.median(runs[batch, "MLX ops"]["gemm"]),
            weights_GBps=bytes_per_step / step / 1e9,
            of_bandwidth=bytes_per_step / step / bandwidth, vs_memory_bound=step / memory_bound,
            vs_compute_bound=step / (flops_per_row * batch / split_rate),
            stored_step_ms=1e3 * stored_step, stored_vs_kernels=stored_step / step,
            stored_vs_memory_bound=stored_step / (stored_bytes / bandwidth),
            int8_step_ms=1e3 * int8_step, int8_vs_kernels=int8_step / step,
            step_ms_all=[1e3 * x for x in runs[batch, "kernels"]["step"]],
            mlx_step_ms_all=[1e3 * x for x in runs[batch, "MLX ops"]["step"]],
            stored_step_ms_all=[1e3 * x for x in runs[batch, "as stored"]["step"]],
            int8_step_ms_all=[1e3 * x for x in runs[batch, "int8"]["step"]],
        ))
    data = {
        "model": model_name, "steps": args.steps, "rounds": args.rounds,
        "bytes_per_step": bytes_per_step, "copy_bandwidth_GBps": bandwidth / 1e9,
        "memory_bound_ms": 1e3 * memory_bound, "matmul_params": matmul_params(model),
        "stored_bytes_per_step": stored_bytes,
        "stored_memory_bound_ms": 1e3 * stored_bytes / bandwidth,
        "gemm_GFLOPs": rate / 1e9, "gemm_all_cores_GFLOPs": split_rate / 1e9,
        "openblas_threads": openblas_threads(), "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    save_results(NAME + ("_quick" if args.quick else ""), data,
                 [make_table(rows, data), make_goals(rows, data)], make_figure(rows, data),
                 rounds=args.rounds)


if __name__ == "__main__":
    main()
