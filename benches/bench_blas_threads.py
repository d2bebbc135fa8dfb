"""OpenBLAS on one thread or on every core, on a quiet machine and next to a busy neighbour.

``tiny_llm`` sets ``OPENBLAS_NUM_THREADS=1`` unless you set it yourself. ``bench_model``
compares one thread (its configuration (c)) with every core ((cN)) on a quiet machine; this
script adds the case the default is chosen for: another process keeping one core busy, as
on a shared machine, a laptop doing other work, or a CI runner. OpenBLAS's worker threads
spin while they wait for each other, so a worker that loses its core to the neighbour can
hold up every matmul.

Four runs per round, each in a fresh process (``bench_model.py --config c|cN``, the same
worker as ``bench_model``): one thread and every core, each on a quiet machine and with a
neighbour, a ``python -c "while True: pass"`` process started just before the run and
killed just after it (one spinning thread: one core's worth of work). Each run measures a
single greedy stream (a ``--prompt-tokens`` prompt in one forward, then ``--decode-tokens``
new tokens) and serving ``--serve-requests`` requests at once through ``LLMEngine`` (the
definitions are ``bench_model``'s). ``--rounds`` rounds (default 3), the order of the four
runs reversed every other round; medians, and the median of the per-round ratios every
core / one thread.

A second table asks the same of the engine's prefill products: a 512-row forward's matmuls
(every linear layer, ``GemmProbe``) by OpenBLAS on one thread, by OpenBLAS on every core,
and by OpenBLAS on one thread called on blocks of weight rows spread over the extension's
worker pool (what the engine does, ``tiny_llm/kernels/cpu_kernels.py``), each in a fresh process
(``--gemm-worker``), quiet and beside the same neighbour; the median of 5 products.

    python benches/bench_blas_threads.py          # about 7 minutes on 2 cores
    python benches/bench_blas_threads.py --quick  # smoke run, writes *_quick.*
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any

from bench_model import THREAD_ROWS, run_config
from common import Table, bench_parser, save_results, use_cpu

NAME = "bench_blas_threads"
RUNS = [(config, busy) for busy in (False, True) for config in ("c", "cN")]


@contextmanager
def neighbour(busy: bool):
    """A process spinning on one core for the duration of the block (if ``busy``)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def value(run: dict[str, Any], where: str | None, key: str) -> float:
    return run[key] if where is None else run[where][key]


def make_table(rounds: list[dict[tuple[str, bool], Any]], threads: int,
               settings: dict[str, Any]) -> Table:
    rows = []
    for busy in (False, True):
        for label, where, key in THREAD_ROWS:
            one = [value(r[("c", busy)], where, key) for r in rounds]
            every = [value(r[("cN", busy)], where, key) for r in rounds]
            rows.append(["busy neighbour" if busy else "quiet", label, statistics.median(one),
                         statistics.median(every),
                         statistics.median(b / a for a, b in zip(one, every, strict=True))])
    serve = rounds[0][("c", False)]["serve"]
    return Table(
        title="OpenBLAS on 1 thread vs every core, quiet and next to a busy neighbour",
        headers=["machine", "measure", "1 thread", f"{threads} threads",
                 f"{threads} threads / 1 thread"],
        rows=rows,
        formats=["", "", ".2f", ".2f", ".2f"],
        note=(
            "Busy neighbour: one other process spinning on one core. Single stream: batch 1, "
            f"greedy, a {settings['prompt_tokens']}-token prompt in one forward, then "
            f"{settings['decode_tokens']} new tokens (bench_model's worker). Serving: "
            f"{serve['requests']} requests at once through LLMEngine, prompts of "
            f"{serve['prompt_tokens']} tokens, {serve['decode_tokens']} new tokens each. "
            f"Medians over {len(rounds)} rounds; the ratio is the median of per-round "
            "ratios (above 1: every core is better for tok/s, worse for ms and s)."
        ),
    )


GEMM_ROWS = 512
GEMM_RUNS = {"OpenBLAS, 1 thread": ("1", False), "OpenBLAS, every core": (None, False),
             "1-thread OpenBLAS on the pool": ("1", True)}  # label -> (threads, split)


def gemm_worker(split: bool, quick: bool) -> None:
    """Print the GFLOP/s of a GEMM_ROWS-row forward's matmuls (this process's OpenBLAS)."""
    from tiny_llm import split_blas

    from bench_cpu_decode import matmul_params
    from common import GemmProbe, load_model

    model = load_model(quick)[0]
    assert split_blas() or not split, "the pool runs OpenBLAS on one thread only"
    probe = GemmProbe(model)
    decode_rows = 0 if split else None  # 0 decode rows: every row by the split BLAS
    times = [probe.time(GEMM_ROWS, 1, decode_rows) for _ in range(6)][1:]
    head = probe.lm_head.size  # multiplied at the one row whose logits a prefill needs
    flops = 2 * ((matmul_params(model) - head) * GEMM_ROWS + head)
    print(json.dumps({"GFLOPs": flops / statistics.median(times) / 1e9}))


def run_gemm(label: str, quick: bool) -> float:
    threads, split = GEMM_RUNS[label]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=threads or str(os.cpu_count()))
    cmd = [sys.executable, os.path.abspath(__file__), "--gemm-worker",
           "split" if split else "blas", *(["--quick"] if quick else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["GFLOPs"]


def make_gemm_table(rounds: list[dict[tuple[str, bool], float]]) -> Table:
    first = next(iter(GEMM_RUNS))
    rows = []
    for busy in (False, True):
        for label in GEMM_RUNS:
            rates = [r[(label, busy)] for r in rounds]
            rows.append(["busy neighbour" if busy else "quiet", label, statistics.median(rates),
                         statistics.median(r[(label, busy)] / r[(first, busy)] for r in rounds),
                         statistics.median(r[(label, busy)] / r[(label, False)] for r in rounds)])
    return Table(
        title=f"The prefill products on every core: OpenBLAS's threads or the extension's pool "
              f"({GEMM_ROWS} rows)",
        headers=["machine", "matmuls by", "GFLOP/s", "/ 1 thread", "/ same, quiet"],
        rows=rows, formats=["", "", ".1f", ".2f", ".2f"],
        note=(f"Every linear layer of the model at {GEMM_ROWS} rows and the vocabulary "
              "projection at one, on random inputs, in a fresh process per cell; the median "
              f"of 5. Medians over {len(rounds)} rounds; ratios are medians of per-round "
              "ratios."),
    )


def main() -> None:
    if "--gemm-worker" in sys.argv:
        return gemm_worker(sys.argv[sys.argv.index("--gemm-worker") + 1] == "split",
                           "--quick" in sys.argv)
    ap = bench_parser(__doc__)
    use_cpu()
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 256 (quick: 64)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="default 64 (quick: 8)")
    ap.add_argument("--serve-requests", type=int, default=None, help="default 8 (quick: 4)")
    args = ap.parse_args()
    if args.quick and "--rounds" not in sys.argv:
        args.rounds = 1
    args.prompt_tokens = args.prompt_tokens or (64 if args.quick else 256)
    args.decode_tokens = args.decode_tokens or (8 if args.quick else 64)
    args.serve_requests = args.serve_requests or (4 if args.quick else 8)
    t0 = time.perf_counter()
    rounds: list[dict[tuple[str, bool], Any]] = []
    gemm_rounds: list[dict[tuple[str, bool], float]] = []
    gemm_runs = [(label, busy) for busy in (False, True) for label in GEMM_RUNS]
    for r in range(args.rounds):
        result = {}
        for config, busy in RUNS if r % 2 == 0 else RUNS[::-1]:
            with neighbour(busy):
                result[(config, busy)] = run_config(config, args)
            x = result[(config, busy)]
            print(f"[{time.perf_counter() - t0:5.0f}s] round {r + 1}: {config:2s} "
                  f"{'busy ' if busy else 'quiet'} prefill {x['prefill_tok_s']:6.1f} tok/s, "
                  f"decode {x['decode_tok_s']:5.2f} tok/s, serving {x['serve']['tok_s']:5.1f} "
                  "tok/s", flush=True)
        rounds.append(result)
        gemms = {}
        for label, busy in gemm_runs if r % 2 == 0 else gemm_runs[::-1]:
            with neighbour(busy):
                gemms[(label, busy)] = run_gemm(label, args.quick)
            print(f"[{time.perf_counter() - t0:5.0f}s] round {r + 1}: {label} "
                  f"{'busy ' if busy else 'quiet'} {gemms[(label, busy)]:6.1f} GFLOP/s",
                  flush=True)
        gemm_rounds.append(gemms)
    threads = rounds[0][("cN", False)]["openblas_threads"]
    data = {
        "settings": {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                     "serve_requests": args.serve_requests, "cores": os.cpu_count()},
        "per_round": [{f"{c}{' busy' if b else ''}": {k: v for k, v in x.items() if k != "tokens"}
                       for (c, b), x in rnd.items()} for rnd in rounds],
        "gemm_per_round": [{f"{label}{' busy' if b else ''}": v for (label, b), v in g.items()}
                           for g in gemm_rounds],
        "wall_s": time.perf_counter() - t0,
    }
    tables = [make_table(rounds, threads, data["settings"]), make_gemm_table(gemm_rounds)]
    save_results(NAME + ("_quick" if args.quick else ""), data, tables, rounds=args.rounds)


if __name__ == "__main__":
    main()
