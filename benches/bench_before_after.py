"""Two commits of the engine side by side: the serving workloads a change to the engine's core
must not slow down, and must not change a token of.

A refactor of the core (the step, the model runner, the step metadata, page bookkeeping)
promises the same tokens at the same speed. This script checks both, in one run: the
working tree's ``src`` (``HEAD``, or uncommitted changes) and a base commit's, checked out
into a temporary git worktree, each in a process of its own that imports the tree's own
benchmarks for the workloads (so each imports its own package's names; the two trees'
workloads must be the same, token for token, or the run stops), the two alternating in
every round (the order rotated; ``--rounds``, default 3; medians). Each tree runs its own
extension: the base shares the working tree's build where its ``src/extensions`` is the
same, and is built on its own otherwise.

Workloads (SmolLM2-135M-Instruct, float32, on the CPU):

- ``W32``: ``bench_cpu_speed``'s serving workload (32 requests of 32-512 prompt and 32-128
  output tokens, all at t=0) through the default engine;
- the progression: ``bench_week3_day5``'s workload (16 requests, 8 sharing a system prefix)
  through each of its nine engine configurations, one after another;
- ``one request``: ``bench_vs_llama_cpp``'s request (a 512-token prompt, then 64 new
  tokens; ``--quick``: 64 and 8) through the default engine on the GGUF's weights as
  stored (4-bit layers, an 8-bit embedding), and the same with int8 activations.

``--workloads`` runs some of them (a change aimed at one request's decode need not wait for
the progression).

Reported per workload and configuration: output tok/s of each tree (median), after / before,
and whether every request's greedy tokens are the base's.

    python benches/bench_before_after.py --base 1cd6b45   # about 15 minutes on 2 cores
    python benches/bench_before_after.py --quick          # the uncommitted change against
                                                          # HEAD, tiny model, small workloads
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCHES_ENV = "TINY_LLM_BENCHES"
if __name__ == "__main__" and "--worker" in sys.argv:
    sys.path[0] = os.environ[BENCHES_ENV]  # the tree's own benchmarks, and its common

from common import REPO_ROOT, Table, bench_parser, save_results  # noqa: E402

NAME = "bench_before_after"
W32 = "W32 (default engine)"
ONE = "one request, as stored"
WORKLOADS = ("w32", "progression", "one-request")
# Attention options as a base before their renaming (640e6d9) names them.
FORMER_NAMES = {"page_walk": "reference", "tiled_walk": "flash_reference"}


def serve(engine: Any, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    """Every request added at t=0, stepped to the end; wall time, each request's tokens, and
    the workload's digest."""
    from common import greedy

    ids = [engine.add_request({"prompt_token_ids": p}, greedy(n))
           for p, n in zip(prompts, outputs, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    seconds = time.perf_counter() - start
    generated = sum(map(len, tokens.values()))
    workload = hashlib.sha256(json.dumps([prompts, outputs]).encode()).hexdigest()
    return dict(seconds=seconds, tok_per_s=generated / seconds,
                tokens=[tokens[i] for i in ids], workload=workload)


def worker(quick: bool, workloads: list[str]) -> None:
    """Serve ``workloads`` on the ``tiny_llm`` that PYTHONPATH names, with the workloads of
    the benchmarks ``TINY_LLM_BENCHES`` names (``quick``: their quick ones, on their tiny
    model); print JSON."""
    # Names every tree since the engine package has (this function serves any base).
    import tiny_llm
    from tiny_llm.day3_paged_kv import blocks_needed
    from tiny_llm.engine import ATTENTION_BACKENDS, LLMEngine

    from bench_cpu_speed import workload as w32_workload
    from bench_week3_day5 import CONFIGS, FULL, MAX_NUM_SEQS, PAGE_SIZE, QUICK
    from bench_week3_day5 import workload as progression_workload
    from common import load_model, use_cpu

    use_cpu()
    model, tokenizer, _ = load_model(quick)
    results = {"src": str(Path(tiny_llm.__file__).parent)}
    if "one-request" in workloads:
        results.update(one_request(tokenizer, quick))
    if "w32" in workloads:
        prompts, outputs = w32_workload(quick, model.config.vocab_size)
        results[W32] = serve(LLMEngine(model, tokenizer), prompts, outputs)
    if "progression" not in workloads:
        print(json.dumps(results))
        return
    sizes = QUICK if quick else FULL
    prompts, outputs = progression_workload(sizes, model.config.vocab_size)
    longest = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    num_pages = MAX_NUM_SEQS * blocks_needed(longest, PAGE_SIZE)
    for label, opts in CONFIGS:
        if opts.get("attention") not in (None, *ATTENTION_BACKENDS):  # the base's older name
            opts = dict(opts, attention=FORMER_NAMES[opts["attention"]])
        paged = dict(num_pages=num_pages) if opts.get("kv_cache", "paged") == "paged" else {}
        engine = LLMEngine(model, tokenizer, max_num_seqs=MAX_NUM_SEQS,
                           max_model_len=sizes["max_model_len"], **paged, **opts)
        results[label] = serve(engine, prompts, outputs)
    print(json.dumps(results))


def one_request(tokenizer: Any, quick: bool) -> dict[str, Any]:
    """bench_vs_llama_cpp's request on the weights as stored, with float and with int8
    activations: its prefill step and then its decode steps."""
    import random

    from tiny_llm import LLMEngine, load

    stored = load(None, dequantize=False)[0]
    prompt, new = (64, 8) if quick else (512, 64)
    rng = random.Random(0)
    tokens = [rng.randrange(100, stored.config.vocab_size) for _ in range(prompt)]
    results = {}
    for label, int8 in ((ONE, False), (f"{ONE}, int8 activations", True)):
        engine = LLMEngine(stored, tokenizer, max_num_batched_tokens=max(512, prompt),
                           enable_prefix_caching=False, int8_activations=int8)
        results[label] = serve(engine, [tokens], [new])
    return results


def run_tree(src: Path, quick: bool, workloads: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src), "TINY_LLM_GPU_REHEARSAL": "0",
           BENCHES_ENV: str(src.parent / "benches")}
    command = [sys.executable, __file__, "--worker", *(["--quick"] if quick else []),
               "--workloads", *workloads]
    out = subprocess.run(command, env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout  # stderr: the console
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["src"]) != src / "tiny_llm":
        raise SystemExit(f"the worker imported {result['src']}, not {src}")
    return result


def base_tree(base: str, root: Path) -> Path:
    """A worktree of ``base`` under ``root`` with its extension: the working tree's build
    where ``src/extensions`` is the same, else its own, built here as ``make setup`` does."""
    tree = root / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), base], cwd=REPO_ROOT,
                   check=True, capture_output=True)
    native, target = REPO_ROOT / "src/tiny_llm/_native", tree / "src/tiny_llm/_native"
    target.mkdir(exist_ok=True)
    for built in native.glob("*.so"):
        shutil.copy2(built, target / built.name)
    same = subprocess.run(["git", "diff", "--quiet", base, "--", "src/extensions"],
                          cwd=REPO_ROOT).returncode == 0
    if not same:
        print(f"{base} has other src/extensions: building its extension", flush=True)
        build = root / "build"
        for cmd in (["cmake", "-S", str(tree / "src/extensions"), "-B", str(build),
                     f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"],
                    ["cmake", "--build", str(build), f"-j{os.cpu_count() or 1}"]):
            subprocess.run([str(Path(sys.executable).parent / cmd[0]), *cmd[1:]], check=True,
                           stdout=subprocess.DEVNULL)
        for old in target.glob("_ext*.so"):
            old.unlink()
        for built in build.glob("_ext*.so"):
            shutil.copy2(built, target / built.name)
    return tree


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--base", default="HEAD",
                    help="the commit to compare against (default HEAD: the uncommitted change)")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                    help="the workloads to serve (default: all)")
    args = ap.parse_args()
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=REPO_ROOT,
                              check=True, capture_output=True, text=True).stdout.strip()
    trees = {"after": REPO_ROOT / "src"}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trees["before"] = base_tree(base_rev, Path(tmp)) / "src"
            rounds: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for r in range(args.rounds):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for side in order:
                    rounds[side].append(run_tree(trees[side], args.quick, args.workloads))
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / "base")],
                           cwd=REPO_ROOT, check=False, capture_output=True)
    labels = [k for k in rounds["after"][0] if k != "src"]
    for label in labels:
        if rounds["after"][0][label]["workload"] != rounds["before"][0].get(label, {}).get(
                "workload"):
            raise SystemExit(f"{label}: the two trees' benchmarks serve different workloads")
    rows, data = [], {}
    for label in labels:
        tps = {side: statistics.median(rnd[label]["tok_per_s"] for rnd in rounds[side])
               for side in rounds}
        same = all(rnd[label]["tokens"] == rounds["before"][0][label]["tokens"]
                   for side in rounds for rnd in rounds[side])
        data[label] = {side: [rnd[label]["tok_per_s"] for rnd in rounds[side]]
                       for side in rounds} | {"same_tokens": same}
        # Each round's two runs follow each other: their ratio cancels a drift of the
        # machine's speed slower than a round, which a ratio of medians does not.
        paired = [a[label]["tok_per_s"] / b[label]["tok_per_s"]
                  for a, b in zip(rounds["after"], rounds["before"], strict=True)]
        data[label]["paired_ratios"] = paired
        rows.append([label, tps["before"], tps["after"], tps["after"] / tps["before"],
                     statistics.median(paired), min(paired), max(paired),
                     "yes" if same else "no"])
    table = Table(
        title=f"The engine before ({base_rev}) and after: output tok/s, side by side",
        headers=["workload / configuration", "before tok/s", "after tok/s", "after / before",
                 "per round", "lowest", "highest", "same tokens"],
        rows=rows, formats=["", ".1f", ".1f", ".3f", ".3f", ".3f", ".3f", ""],
        note=(("A tiny random model (--quick: the scripts' quick workloads)" if args.quick
               else "SmolLM2-135M-Instruct (float32)") + " on the CPU; W32: "
              "bench_cpu_speed's serving workload, all at t=0, default engine; one request: "
              "bench_vs_llama_cpp's on the GGUF's weights as stored (the whole request, "
              "prefill and decode); the other rows: bench_week3_day5's progression workload "
              "per configuration. Each tree in its "
              "own process, the two alternating every round; medians; per round: the median of "
              "each round's after / before (its two runs back to back), with the lowest and "
              "highest; same tokens: every "
              "request's greedy tokens equal in every round of both trees."))
    save_results(NAME + ("_quick" if args.quick else ""), dict(base=base_rev, results=data),
                 [table], rounds=args.rounds)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker("--quick" in sys.argv, sys.argv[sys.argv.index("--workloads") + 1:])
    else:
        main()
