"""One request on the CPU: the engine next to llama.cpp on the same GGUF file.

llama.cpp is what a Linux user would otherwise run a GGUF model with. It is not a
dependency of this project: build its ``llama-bench`` tool once and pass its path. The
llama.cpp sources ship inside the ``llama-cpp-python`` source package on PyPI:

    pip download llama-cpp-python --no-deps --no-binary=:all: -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-*.tar.gz -C /tmp/llama
    cd /tmp/llama/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-bench      # about 10 minutes on 2 cores

Each round, in turn (``--rounds``, default 3; medians):

- **llama.cpp**: ``llama-bench -m <the default GGUF> -p 512 -n 0 -t <cores>`` (prompt
  processing of 512 tokens) and ``-p 0 -n 64 -d 512`` (generation of 64 after a context of
  512, as the engine's decode steps attend over the prompt; without ``-d`` llama-bench
  generates from an empty context), with the file's own weights (Q4_1 linear layers, a
  Q8_0 embedding: about 92 MB read per token) on every core;
- **the engine, float32**: the default engine on the same file (dequantized to float32 on
  the CPU, 538 MB per token), one request: a 512-token prompt, then 64 new tokens, greedy.
  Prefill tok/s = 512 / the prompt's step time; decode tok/s = 63 / the time of the other
  steps;
- **the engine, as stored**: the same, the file's weights kept as they are stored
  (``load(dequantize=False)``, ``--quantized`` on the command line): the decode rows read
  the packed 4- and 8-bit bytes (the extension's ``quantized_linear``), the prompt's rows
  dequantize blocks for OpenBLAS;
- **the engine, as stored, int8 activations**: the same with ``int8_activations=True``
  (``--int8-activations``): the decode rows rounded to int8 per 32 values, as llama.cpp
  does for its quantized formats, and multiplied by the packed weights as integers;
- **the engine, as stored, layers op by op**: as stored with ``fused_layers=False``: each
  decode step's layers as their sixteen ops each instead of one fused op
  (``kernels/cpu_fused.py``), the same bits, to show what the fusion pays.

All use every core. The table gives each one's bytes per token next to its speed, and its
decode step against the memory bound: those bytes once at the copy bandwidth measured in
the run.

    python benches/bench_vs_llama_cpp.py --llama-bench PATH          # about a minute
    python benches/bench_vs_llama_cpp.py --llama-bench PATH --quick  # writes *_quick.*
    python benches/bench_vs_llama_cpp.py --quick    # the engine's rows only, said at the start
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tiny_llm import LLMEngine, default_model_path, load

from bench_model import decode_bytes_per_token
from common import (
    Table,
    bench_parser,
    copy_bandwidth,
    goals_table,
    greedy,
    load_model,
    save_results,
    spread,
    use_cpu,
)
from mlx.utils import tree_flatten

NAME = "bench_vs_llama_cpp"


def run_llama_cpp(binary: Path, gguf: Path, prompt: int, new: int) -> dict[str, float]:
    def bench(*args: str) -> dict[str, Any]:
        cmd = [str(binary), "-m", str(gguf), *args, "-t", str(os.cpu_count()), "-r", "1",
               "-o", "json"]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                         check=True).stdout)[0]

    # Its generation test starts from an empty context unless given a depth: the engine's
    # new tokens attend over the prompt, so llama.cpp's do too (-d).
    prefill = bench("-p", str(prompt), "-n", "0")
    decode = bench("-p", "0", "-n", str(new), "-d", str(prompt))
    return dict(prefill_tok_s=prefill["avg_ts"], decode_tok_s=decode["avg_ts"],
                file_bytes=prefill["model_size"])


def run_engine(model: Any, tokenizer: Any, prompt: int, new: int, seed: int,
               int8: bool = False, fused: bool = True) -> dict[str, float]:
    rng = random.Random(seed)
    engine = LLMEngine(model, tokenizer, max_num_batched_tokens=max(512, prompt),
                       enable_prefix_caching=False, int8_activations=int8, fused_layers=fused)
    tokens = [rng.randrange(100, model.config.vocab_size) for _ in range(prompt)]
    engine.add_request({"prompt_token_ids": tokens}, greedy(new))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return dict(prefill_tok_s=prompt / times[0], decode_tok_s=(new - 1) / sum(times[1:]))


ROWS = (("llama.cpp (GGUF weights)", "llama"), ("engine (float32)", "engine"),
        ("engine (GGUF weights as stored)", "engine_quantized"),
        ("engine (as stored, int8 activations)", "engine_int8"),
        ("engine (as stored, layers op by op)", "engine_ops"))


def make_table(res: dict[str, Any], data: dict[str, Any]) -> Table:
    rows = []
    llama = res.get("llama")  # None: llama-bench was not given, its row and ratios left out
    for label, key in ROWS:
        if key not in res:
            continue
        r = res[key]
        bound_ms = r["bytes_per_token"] / data["copy_bandwidth"] * 1e3
        rows.append([label, r["bytes_per_token"] / 1e6, r["prefill_tok_s"], r["decode_tok_s"],
                     bound_ms / (1e3 / r["decode_tok_s"]),
                     r["prefill_tok_s"] / llama["prefill_tok_s"] if llama else None,
                     r["decode_tok_s"] / llama["decode_tok_s"] if llama else None])
    return Table(
        title=f"One request, {data['model']}: the engine and llama.cpp on the same GGUF file",
        headers=["", "MB read per token", "prefill tok/s", "decode tok/s",
                 "decode at memory bound", "prefill / llama.cpp", "decode / llama.cpp"],
        rows=rows, formats=["", ".0f", ".1f", ".1f", ".0%", ".2f", ".2f"],
        note=(f"A {data['prompt']}-token prompt, then {data['new']} new tokens, one request, "
              f"{data['cores']} threads each. llama.cpp: llama-bench (pp{data['prompt']}, "
              f"tg{data['new']} @ d{data['prompt']}: the new tokens after the prompt's context) "
              "with the file's weights; its MB per token is the file's size. "
              "The engine: the defaults, weights dequantized to float32, or kept as stored "
              "(4-bit layers, an 8-bit embedding), and so with int8 activations or with a decode "
              "step's layers op by op instead of fused. Decode at "
              "memory bound: the MB per token at the copy bandwidth "
              f"({data['copy_bandwidth'] / 1e9:.1f} GB/s) over the decode step. Medians of "
              f"{data['rounds']} rounds; ratios of medians."),
    )


def make_goals(res: dict[str, Any]) -> Table:
    goals = []
    for label, key in ROWS[1:-1]:  # not the layers op by op: the before of the fused layers
        for kind in ("prefill", "decode"):
            ratio = res[key][f"{kind}_tok_s"] / res["llama"][f"{kind}_tok_s"]
            goals.append((f"{label}: {kind} faster than llama.cpp",
                          f"{ratio:.2f}x llama.cpp's tok/s", ratio > 1))
    return goals_table("The goal next to llama.cpp: one request, ahead on the same GGUF", goals)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--llama-bench", type=Path,
                    help="path of llama.cpp's llama-bench (see the docstring); without it, "
                         "the engine's rows only")
    args = ap.parse_args()
    use_cpu()
    if args.llama_bench is None:
        print("llama.cpp is not measured: no --llama-bench PATH was given (`python "
              "benches/bench_vs_llama_cpp.py --help` says how to build it); its row, the ratio "
              "columns and the goals are left out", flush=True)
    elif not args.llama_bench.is_file():
        raise SystemExit(f"{args.llama_bench} is not llama-bench; see how to build it with "
                         "`python benches/bench_vs_llama_cpp.py --help`")
    if args.quick and "--rounds" not in sys.argv:
        args.rounds = 1
    prompt, new = (64, 8) if args.quick else (512, 64)
    model, tokenizer, _ = load_model(False)  # the GGUF is llama.cpp's input too
    stored = load(None, dequantize=False)[0]
    gguf = default_model_path()
    model_name = gguf.name.split(".")[0]  # both formats of SmolLM2-135M-Instruct
    bandwidth = copy_bandwidth()
    engines = {"engine": (model, False, True), "engine_quantized": (stored, False, True),
               "engine_int8": (stored, True, True), "engine_ops": (stored, False, False)}
    for m, int8, fused in engines.values():
        run_engine(m, tokenizer, 16, 2, seed=99, int8=int8, fused=fused)  # warmup
    keys = (["llama"] if args.llama_bench else []) + list(engines)
    rounds: dict[str, list[dict[str, float]]] = {key: [] for key in keys}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # the order rotates
            out = (run_llama_cpp(args.llama_bench, gguf, prompt, new) if key == "llama"
                   else run_engine(engines[key][0], tokenizer, prompt, new, seed=r,
                                   int8=engines[key][1], fused=engines[key][2]))
            rounds[key].append(out)
            print(f"[{time.perf_counter() - t0:5.0f}s] round {r + 1}: {key:16s} prefill "
                  f"{out['prefill_tok_s']:7.1f} tok/s, decode {out['decode_tok_s']:6.1f} tok/s",
                  flush=True)
    res: dict[str, Any] = {}
    for key, runs in rounds.items():
        res[key] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        res[key]["decode_rounds"] = spread([x["decode_tok_s"] for x in runs])
    if "llama" in res:
        res["llama"]["bytes_per_token"] = res["llama"].pop("file_bytes")
    c = model.config
    for key, (m, _, _) in engines.items():
        res[key]["bytes_per_token"] = decode_bytes_per_token(
            dict(tree_flatten(m.parameters())), c.vocab_size, c.tie_word_embeddings)
    data = {"model": model_name, "gguf": gguf.name, "prompt": prompt, "new": new,
            "cores": os.cpu_count(), "rounds": args.rounds, "results": res,
            "copy_bandwidth": bandwidth,
            "wall_s": time.perf_counter() - t0}
    tables = [make_table(res, data)] + ([make_goals(res)] if "llama" in res else [])
    save_results(NAME + ("_quick" if args.quick else ""), data, tables, rounds=args.rounds)


if __name__ == "__main__":
    main()
