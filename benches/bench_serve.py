"""Online serving: `tiny-llm serve` against `mlx_lm.server`, Poisson arrivals, same weights.

Both servers load one Hugging Face folder written here from the default model (SmolLM2-135M-
Instruct dequantized to float32, so the weights are identical) and run on this machine with
the same GEMM (mlx-lm's server is started after ``import tiny_llm``, which interposes
OpenBLAS for MLX, with the same OPENBLAS_NUM_THREADS). For each offered load (requests per
second, Poisson arrivals), the same requests are sent to each server in turn, streamed with
the official ``openai`` client: chat prompts, temperature 0, ``max_tokens`` fixed.

Reported per server and rate: TTFT, TPOT (time per output token after the first, per
request) and ITL (gap between streamed chunks) at p50 and p99, and throughput (output
tokens from ``usage`` / wall time from first send to last token). Rounds interleave the two
servers; medians over rounds.

    python benches/bench_serve.py           # about 15 minutes on 2 cores
    python benches/bench_serve.py --quick   # a tiny random model, one rate, writes *_quick.*
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tiny_llm.testing.models import hf_config_of

import mlx.core as mx
from common import REPO_ROOT, Table, bench_parser, load_model, percentile, save_results, spread
from mlx.utils import tree_flatten

QUESTIONS = ["Name three rivers in Europe.", "Why is the sky blue?", "Give a tip for sleeping "
             "well.", "What is a prime number?", "Describe a cat in two sentences.",
             "How do plants make food?", "What does a compiler do?", "Suggest a name for a "
             "boat."]


def export_folder(model, tokenizer, folder: Path) -> None:
    """The model as a Hugging Face folder both servers load: float32 safetensors, config,
    tokenizer.json and the chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(hf_config_of(model)))
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    eos = tokenizer.backend.id_to_token(tokenizer.eos_token_id)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tokenizer.chat_template, "eos_token": eos, "bos_token": None,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_id(kind: str, folder: Path) -> str:
    """What each server calls the model (mlx-lm: the path it loaded; another name would
    make it try the hub)."""
    return "m" if kind == "tiny-llm" else str(folder)


def start(kind: str, folder: Path, port: int) -> subprocess.Popen:
    python = sys.executable
    if kind == "tiny-llm":
        cmd = [python, "-m", "tiny_llm.cli", "serve", "--model", str(folder), "--port",
               str(port), "--served-model-name", "m", "--max-num-seqs", "32",
               "--dtype", "float32"]  # as mlx-lm's server holds the folder's arrays
    else:
        cmd = [python, "-c", "import sys, tiny_llm; from mlx_lm.server import main; "
               "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; main()",
               "--model", str(folder), "--port", str(port), "--decode-concurrency", "32"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=REPO_ROOT)
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    deadline = time.monotonic() + 180
    while True:
        try:
            client.chat.completions.create(model=model_id(kind, folder), max_tokens=1,
                                   messages=[{"role": "user", "content": "hi"}])
            return proc
        except Exception:  # noqa: BLE001  (not up yet)
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{kind} did not start: {proc.stderr.read()[-2000:]}") from None
            time.sleep(0.5)


def one_request(client, model: str, question: str, max_tokens: int) -> dict[str, Any]:
    sent = time.perf_counter()
    stamps, tokens = [], None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return {"sent": sent, "stamps": stamps, "tokens": tokens or len(stamps)}


def run_load(port: int, model: str, rate: float, n: int, max_tokens: int,
             seed: int) -> dict[str, float]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                           max_retries=0, timeout=600)
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    results: list[dict] = [None] * n
    begin = time.perf_counter()

    def fire(i: int) -> None:
        time.sleep(max(0.0, begin + arrivals[i] - time.perf_counter()))
        results[i] = one_request(client, model, QUESTIONS[i % len(QUESTIONS)], max_tokens)

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ttft = [r["stamps"][0] - r["sent"] for r in results if r["stamps"]]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1)
            for r in results if r["tokens"] > 1 and len(r["stamps"]) > 1]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    end = max(r["stamps"][-1] for r in results if r["stamps"])
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "throughput": sum(r["tokens"] for r in results) / (end - begin)}


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--rates", default="0.5,1,2,4", help="offered loads, requests/s")
    ap.add_argument("--requests", type=int, default=24, help="requests per load")
    args = ap.parse_args()
    model, tokenizer, model_name = load_model(args.quick)
    rates = [4.0] if args.quick else [float(r) for r in args.rates.split(",")]
    n, max_tokens = (8, 16) if args.quick else (args.requests, 64)
    kinds = ["tiny-llm", "mlx-lm"]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        export_folder(model, tokenizer, folder)
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                port = free_port()
                proc = start(kind, folder, port)
                try:
                    name = model_id(kind, folder)
                    run_load(port, name, 2.0, 2, 4, seed=99)  # warm up
                    for rate in rates:
                        runs.setdefault(f"{kind}|{rate}", []).append(
                            run_load(port, name, rate, n, max_tokens, seed=r))
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
            print(f"round {r + 1}/{args.rounds} done", flush=True)

    keys = ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99",
            "throughput"]
    rows, data = [], {}
    for rate in rates:
        for kind in kinds:
            per = runs[f"{kind}|{rate}"]
            data[f"{kind}|{rate}"] = {k: spread([x[k] for x in per]) for k in keys}
            med = {k: statistics.median(x[k] for x in per) for k in keys}
            rows.append([rate, kind, *(med[k] * 1e3 for k in keys[:-1]), med["throughput"]])
    ratio_rows = []
    for rate in rates:
        ours, theirs = runs[f"tiny-llm|{rate}"], runs[f"mlx-lm|{rate}"]
        ratio_rows.append([rate] + [statistics.median(
            [a[k] / b[k] for a, b in zip(ours, theirs, strict=True)]) for k in
            ("throughput", "ttft_p50", "tpot_p50")])
    tables = [
        Table("1. Latency (ms) and throughput (output tok/s) against offered load",
              ["req/s", "server", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
               "ITL p99", "tok/s"], rows,
              ["", "", ".0f", ".0f", ".1f", ".1f", ".1f", ".1f", ".1f"],
              f"{model_name}; {n} chat requests per load, Poisson arrivals, {max_tokens} "
              "tokens max, greedy; median over rounds."),
        Table("2. tiny-llm / mlx-lm (median of per-round ratios)",
              ["req/s", "throughput", "TTFT p50", "TPOT p50"], ratio_rows,
              ["", ".2f", ".2f", ".2f"], "above 1 for throughput, below 1 for latencies: "
              "tiny-llm ahead."),
    ]
    save_results("bench_serve" + ("_quick" if args.quick else ""),
                 {"runs": data, "rates": rates, "requests": n, "max_tokens": max_tokens},
                 tables, plot(rows, rates), rounds=args.rounds)


def plot(rows: list[list], rates: list[float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for kind, style in (("tiny-llm", "o-"), ("mlx-lm", "s--")):
        mine = [r for r in rows if r[1] == kind]
        a.plot(rates, [r[-1] for r in mine], style, label=kind)
        b.plot(rates, [r[2] for r in mine], style, label=kind)
    a.set_xlabel("offered load (requests/s)")
    a.set_ylabel("output tok/s")
    b.set_xlabel("offered load (requests/s)")
    b.set_ylabel("TTFT p50 (ms)")
    b.set_yscale("log")
    a.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
