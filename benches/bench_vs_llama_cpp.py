"""One request on the CPU: the engine next to llama.cpp on the same GGUF file.

llama.cpp is what a Linux user would otherwise run a GGUF model with. It is not a
dependency of this project: build its ``llama-bench`` tool once and pass its path. The
llama.cpp sources ship inside the ``llama-cpp-python`` source package on PyPI:

    pip download llama-cpp-python --no-deps --no-binary=:all: -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-*.tar.gz -C /tmp/llama
    cd /tmp/llama/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-bench llama-batched-bench   # 10-15 minutes

Where the CPU has AMX but the system does not enable it for programs (a virtual machine may
not), ``-march=native`` builds llama.cpp's AMX kernels and ``llama-bench`` dies with an
illegal instruction: configure with ``-DGGML_NATIVE=OFF`` and the CPU's other extensions
named instead (for AVX-512 with VNNI: ``-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_BMI2=ON``).

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

Then many requests at once (``--batched``, default 16 and 32): ``B`` requests of 256
random prompt tokens and 80 new ones each (``--quick``: 4 of 32 and 8), all arriving
together, served to the end by the engine in float32, as stored and as stored with int8
activations (its defaults otherwise, prefix caching off), against
``llama-batched-bench -npp 256 -ntg 80 -npl B`` on the same file (``llama-batched-bench``
is taken from llama-bench's folder): its total time, prefilling the ``B`` prompts in one
batch and then generating ``B`` tokens a step. The ratio is llama.cpp's time over the
engine's.

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


def run_llama_batched(binary: Path, gguf: Path, prompt: int, new: int,
                      batch: int) -> dict[str, float]:
    """``llama-batched-bench``'s one run of ``batch`` sequences: its JSON line (``t``, the
    total seconds; ``speed_tg``, generated tokens per second)."""
    context = batch * (prompt + new) + 16
    cmd = [str(binary), "-m", str(gguf), "-c", str(context), "-b", "2048", "-npp", str(prompt),
           "-ntg", str(new), "-npl", str(batch), "-t", str(os.cpu_count()),
           "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("{") and '"speed_tg"' in line]
    if not lines:
        raise RuntimeError(f"llama-batched-bench printed no result:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def run_engine_batched(model: Any, tokenizer: Any, prompt: int, new: int, batch: int,
                       seed: int, int8: bool = False) -> float:
    """Seconds for the engine to serve ``batch`` requests of ``prompt`` + ``new`` tokens,
    all added at once."""
    rng = random.Random(seed)
    engine = LLMEngine(model, tokenizer, max_num_seqs=max(batch, 32),
                       enable_prefix_caching=False, int8_activations=int8)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(100, model.config.vocab_size)
                                                 for _ in range(prompt)]}, greedy(new))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


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


BATCHED_ROWS = (("engine (float32)", "engine"), ("engine (GGUF weights as stored)",
                                                 "engine_quantized"),
                ("engine (as stored, int8 activations)", "engine_int8"))


def make_batched_table(batched: dict[str, Any], data: dict[str, Any]) -> Table:
    rows = []
    for n in data["batched"]:
        llama = batched.get(f"llama|{n}")
        rows.append(["llama.cpp (llama-batched-bench)", n, llama, None] if llama else [])
        for label, key in BATCHED_ROWS:
            s = batched[f"{key}|{n}"]
            rows.append([label, n, s, llama / s if llama else None])
    return Table(
        title="Many requests at once: the engine and llama-batched-bench on the same file",
        headers=["", "requests", "seconds", "x llama.cpp"],
        rows=[row for row in rows if row], formats=["", "", ".2f", ".2f"],
        note=(f"Each request: {data['batched_prompt']} random prompt tokens, then "
              f"{data['batched_new']} new ones, all arriving together, served to the end, "
              f"{data['cores']} threads each. llama.cpp: llama-batched-bench -npp "
              f"{data['batched_prompt']} -ntg {data['batched_new']} -npl N, its total time "
              "(the prompts in one batch, then N tokens a step). x llama.cpp: its seconds over "
              f"the engine's. Medians of {data['rounds']} rounds."))


def make_goals(res: dict[str, Any], batched: dict[str, Any], sizes: list[int]) -> Table:
    goals = []
    for label, key in ROWS[1:-1]:  # not the layers op by op: the before of the fused layers
        for kind in ("prefill", "decode"):
            ratio = res[key][f"{kind}_tok_s"] / res["llama"][f"{kind}_tok_s"]
            goals.append((f"{label}: {kind} faster than llama.cpp",
                          f"{ratio:.2f}x llama.cpp's tok/s", ratio > 1))
    for n in sizes:
        if f"llama|{n}" not in batched:
            continue
        best = max(BATCHED_ROWS, key=lambda row: -batched[f"{row[1]}|{n}"])
        ratio = batched[f"llama|{n}"] / batched[f"{best[1]}|{n}"]
        goals.append((f"{n} requests at once: 2x llama-batched-bench or more ({best[0]})",
                      f"{ratio:.2f}x", ratio >= 2))
    return goals_table("The goals next to llama.cpp: ahead on the same GGUF", goals)


def batched_rounds(args: Any, engines: dict[str, Any], tokenizer: Any, gguf: Path,
                   binary: Path | None, sizes: list[int], lengths: tuple[int, int],
                   t0: float) -> dict[str, list[float]]:
    """Seconds of every batched run, by ``<key>|<requests>``, the order rotated each round."""
    prompt, new = lengths
    keys = (["llama"] if binary else []) + [key for _, key in BATCHED_ROWS]
    runs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for n in sizes:
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                if key == "llama":
                    seconds = run_llama_batched(binary, gguf, prompt, new, n)["t"]
                else:
                    m, int8, _ = engines[key]
                    seconds = run_engine_batched(m, tokenizer, prompt, new, n, seed=r, int8=int8)
                runs.setdefault(f"{key}|{n}", []).append(seconds)
                print(f"[{time.perf_counter() - t0:5.0f}s] round {r + 1}: {key:16s} {n} requests "
                      f"in {seconds:.2f} s", flush=True)
    return runs


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--llama-bench", type=Path,
                    help="path of llama.cpp's llama-bench (see the docstring); without it, "
                         "the engine's rows only")
    ap.add_argument("--batched", type=int, nargs="+", default=[16, 32],
                    help="numbers of requests served at once in the batched comparison")
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
    batched_prompt, batched_new = (32, 8) if args.quick else (256, 80)
    sizes = [4] if args.quick and "--batched" not in sys.argv else args.batched
    batched_binary = args.llama_bench.with_name("llama-batched-bench") if args.llama_bench \
        else None
    if batched_binary is not None and not batched_binary.is_file():
        print(f"llama.cpp's batched runs are not measured: {batched_binary} is not built "
              "(`cmake --build build --target llama-batched-bench`)", flush=True)
        batched_binary = None
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
    batched_runs = batched_rounds(args, engines, tokenizer, gguf, batched_binary, sizes,
                                  (batched_prompt, batched_new), t0)
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
    batched = {key: statistics.median(runs) for key, runs in batched_runs.items()}
    data = {"model": model_name, "gguf": gguf.name, "prompt": prompt, "new": new,
            "cores": os.cpu_count(), "rounds": args.rounds, "results": res,
            "copy_bandwidth": bandwidth, "batched": sizes, "batched_prompt": batched_prompt,
            "batched_new": batched_new, "batched_results": batched,
            "batched_rounds": batched_runs, "wall_s": time.perf_counter() - t0}
    # The goals second: the book's appendix cites the tables by number.
    tables = [make_table(res, data)] + ([make_goals(res, batched, sizes)] if "llama" in res
                                        else []) + [make_batched_table(batched, data)]
    save_results(NAME + ("_quick" if args.quick else ""), data, tables, rounds=args.rounds)


if __name__ == "__main__":
    main()
