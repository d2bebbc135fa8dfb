"""A decode step on the roofline: where each millisecond of an engine step goes, next to
what the machine could do at best.

For each configuration the engine offers on a CPU (weights in float32 or as stored, int8
activations, a decode step's layers op by op or fused) and each batch size (1, 8 and 32
requests decoding; ``--quick``: 1 and 4 on the tiny model), one engine serves the batch:
``B`` requests of ``P`` random prompt tokens (``P`` = 512 at batch 1, as
``bench_vs_llama_cpp``'s request, 256 at 8, 128 at 32), greedy. Once every request
decodes, ``--steps`` (16) decode steps are timed one by one, and so is batch 1's first
step: its prompt as one prefill chunk. A row of the account is the decode step of median
time (of the round of median time, ``--rounds``, default 3), so that its phases add up to
its time. Each step's wall time is split into what it is, by clocks around each phase:

- **Python**: the scheduler (``Scheduler.schedule``), the sampler (``ModelRunner.sample``,
  its own small evaluation included), and the rest of the step in Python (the step's batch
  and metadata, the kernel plan, committing the step and routing the outputs);
- **graph build**: the model called in Python, building MLX's lazy graph of the forward;
- **evaluation** (``mx.eval`` of the logits), split by the extension's phase clocks
  (``src/extensions/profile.h``: wall time on MLX's stream thread, each kernel's own) into
  the **projections** (every linear layer and the LM head), **attention** over the pages,
  the **K/V write** (the fused layers' copies; op by op, ``paged_kv_write`` counts with MLX's
  own ops), the **vector ops** (norms, RoPE, SwiGLU, residual additions) and **thread
  wait** (the stream thread waiting at the end of a job for the pool's other threads:
  synchronisation and uneven shares); what evaluation spends outside the extension's
  kernels is **MLX**: its scheduling of the graph's nodes and its own ops (the embedding
  lookup, reshapes, op by op the residual additions and the K/V write).

Next to the split, the bound: the step's bytes (every weight once, the embedding's rows
looked up, and the K/V of every request's context in float32, once: a prompt's rows share
theirs) at the copy bandwidth (a 256 MB numpy copy, bytes read + written), and the step's
flops (2 per matmul weight per row, and attention's 4 per key per query head and
dimension). The ceilings are measured in every round just before each configuration's
runs, and the highest of the run bounds every step: a shared machine's speed drifts within
minutes, and a ceiling caught at a slow moment would put a step above its bound.
The projections' time against the weights' bytes at that bandwidth and attention's against
its K/V bytes say how far each is from streaming its bytes. The roofline figure places
each (configuration, batch) by its arithmetic intensity (flops / bytes) and attained flop
rate, under those ceilings: the copy bandwidth and the float32 GEMM rate of OpenBLAS split
over every core (a 1024^3 product).

llama.cpp on the same GGUF goes on the same figure where it is built
(``--llama-bench PATH``; ``llama-batched-bench`` is taken from the same folder; see
``bench_vs_llama_cpp.py`` for how to build both): ``llama-bench``'s generation after a
512-token context at batch 1 and ``llama-batched-bench``'s generation at 8 and 32
sequences after their prompts, placed by the file's bytes and its float16 K/V.

On a GPU (a Mac) the one configuration is the engine's default there, and evaluation is
one line: the Metal kernels, their launches and command buffers run inside ``mx.eval``
where the CPU's clocks do not reach; the bandwidth is an MLX copy on the GPU. To split that
line, ``--metal-capture PATH.gputrace`` records batch 1's timed decode steps of the last
round as a Metal capture (``mx.metal.start_capture``; run with ``MTL_CAPTURE_ENABLED=1``)
that Xcode opens: each kernel's GPU time, and the gaps between command buffers. The GPU
rehearsal runs that configuration on the CPU (its decisions, not a GPU's times).

    python benches/bench_roofline.py [--llama-bench PATH]   # about 5 minutes on 2 cores
    python benches/bench_roofline.py --quick                # tiny random model
    MTL_CAPTURE_ENABLED=1 python benches/bench_roofline.py --metal-capture step.gputrace
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tiny_llm import LLMEngine, default_model_path, load, reference_extension

import mlx.core as mx
from bench_cpu_decode import gemm_rate, matmul_params, stored_model
from bench_model import decode_bytes_per_token
from bench_vs_llama_cpp import run_llama_batched, run_llama_cpp
from common import (
    Table,
    TimedModel,
    bench_device,
    bench_parser,
    copy_bandwidth,
    goals_table,
    greedy,
    load_model,
    save_results,
    use_cpu,
)
from mlx.utils import tree_flatten

NAME = "bench_roofline"

# label -> (weights as stored rather than float32, fused layers, int8 activations)
CPU_CONFIGS = {
    "float32, op by op": (False, False, False),
    "float32, fused": (False, True, False),
    "as stored, op by op": (True, False, False),
    "as stored, fused": (True, True, False),
    "as stored, int8 activations": (True, True, True),
}
GPU_CONFIG = "the default engine"
KERNEL_PHASES = ("projections", "attention", "kv_write", "vector_ops", "thread_wait")
# A step's phases in the account's order (each a column, in ms).
PHASES = ("scheduler", "python_other", "graph", *KERNEL_PHASES, "mlx", "sampler")
PHASE_HEADERS = ("scheduler", "other Python", "graph build", "projections", "attention",
                 "K/V write", "vector ops", "thread wait", "MLX eval", "sampler")


class StepClock:
    """Clocks around one engine's step phases (its scheduler, model and sampler wrapped on
    this instance only), and the extension's kernel clocks read around each step."""

    def __init__(self, engine: LLMEngine, kernel_clocks: bool):
        self.engine, self.kernel_clocks = engine, kernel_clocks
        self.t = dict.fromkeys(("scheduler", "sampler", "graph", "eval", "model_start"), 0.0)
        schedule, sample = engine.scheduler.schedule, engine.runner.sample

        def timed_schedule():
            start = time.perf_counter()
            chunks = schedule()
            self.t["scheduler"] += time.perf_counter() - start
            return chunks

        def timed_sample(*args: Any) -> Any:
            start = time.perf_counter()
            out = sample(*args)
            self.t["sampler"] += time.perf_counter() - start
            return out

        engine.scheduler.schedule = timed_schedule
        engine.runner.sample = timed_sample
        engine.runner.model = TimedModel(engine.model, self.t)

    def step(self) -> dict[str, float]:
        """One engine step, its phases in seconds (and ``wall``)."""
        for k in self.t:
            self.t[k] = 0.0
        ext = reference_extension() if self.kernel_clocks else None
        if ext is not None:
            ext.profile(True)
        start = time.perf_counter()
        self.engine.step()
        wall = time.perf_counter() - start
        kernels = {}
        if ext is not None:
            kernels = ext.profile_totals()
            ext.profile(False)
        t = self.t
        out = {"wall": wall, "scheduler": t["scheduler"], "sampler": t["sampler"],
               "graph": t["graph"], "eval": t["eval"]}
        out["python_other"] = wall - t["scheduler"] - t["sampler"] - t["graph"] - t["eval"]
        out.update({k: kernels.get(k, 0.0) for k in KERNEL_PHASES})
        out["mlx"] = t["eval"] - sum(out[k] for k in KERNEL_PHASES)
        out["pool_jobs"] = kernels.get("pool_jobs", 0)
        return out


def run_batch(model: Any, tokenizer: Any, config: tuple[bool, bool, bool], batch: int,
              prompt: int, steps: int, seed: int, kernel_clocks: bool,
              capture: Path | None = None) -> dict[str, Any]:
    """``batch`` requests of ``prompt`` tokens: the first step's phases (a prefill step) and
    the phases of the median of ``steps`` decode steps, with ``keys``: the keys a row
    attends over, on average over the timed steps. ``capture``: a Metal capture of the
    timed steps written there (on a GPU)."""
    _, fused, int8 = config
    rng = random.Random(seed)
    # Requests whose prompts are done decode while the others prefill: room for those steps.
    new_tokens = steps + 2 + 2 * -(-batch * prompt // 512)
    engine = LLMEngine(model, tokenizer, max_num_seqs=batch, enable_prefix_caching=False,
                       max_num_batched_tokens=max(512, prompt), fused_layers=fused,
                       int8_activations=int8, max_model_len=prompt + new_tokens)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(100, model.config.vocab_size)
                                                 for _ in range(prompt)]}, greedy(new_tokens))
    clock = StepClock(engine, kernel_clocks)
    first = clock.step()
    while any(r.num_computed_tokens < len(r.prompt_token_ids)
              for r in engine.requests.values()):
        clock.step()
    clock.step()  # every request's first decode step (its first token was the prompt's)
    computed = [r.num_computed_tokens for r in engine.requests.values()]
    if capture is not None:
        mx.metal.start_capture(str(capture))
    timed = [clock.step() for _ in range(steps)]
    if capture is not None:
        mx.metal.stop_capture()
    assert len(engine.requests) == batch, "a request finished before the timed steps ended"
    decode = dict(median_step(timed))
    # Timed step i's row reads its request's computed tokens and itself: computed + i + 1.
    decode["keys"] = statistics.mean(computed) + (steps + 1) / 2
    first["keys"] = (prompt + 1) / 2
    return {"prefill": first, "decode": decode}


def median_step(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The step of median wall time (the upper one of an even count): its phases add up to
    its time, which medians taken phase by phase would not."""
    return sorted(steps, key=lambda s: s["wall"])[len(steps) // 2]


def kv_bytes_per_token(config: Any, dtype_bytes: int = 4) -> int:
    """K/V bytes of one token of context over every layer."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def attention_flops(config: Any, queries: int, keys: float) -> float:
    """Scores and values: 2 flops each per (query head, key, dimension), every layer."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return 4.0 * queries * keys * config.num_attention_heads * head_dim * \
        config.num_hidden_layers


def step_volume(model_bytes: int, matmul_weights: int, config: Any, rows: int,
                keys_per_row: float, kv_tokens: float, kv_dtype_bytes: int = 4
                ) -> dict[str, float]:
    """A step's bytes (weights once, the ``kv_tokens`` tokens of K/V its rows attend over
    once) and flops."""
    kv = kv_tokens * kv_bytes_per_token(config, kv_dtype_bytes)
    return {"weight_bytes": model_bytes, "kv_bytes": kv,
            "flops": 2.0 * matmul_weights * rows + attention_flops(config, rows, keys_per_row)}


def gpu_copy_bandwidth(mbytes: int = 256, repeats: int = 5) -> float:
    """Bytes read + written per second by a large copy on MLX's default device."""
    src = mx.ones((mbytes * 2**20 // 4,), dtype=mx.float32)
    mx.eval(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        mx.eval(src + 0)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times[1:])


def account_rows(res: dict[str, Any], data: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for label in data["configs"]:
        for batch in [*data["batches"], "prefill"]:
            key = f"{label}|{batch}"
            if key not in res:
                continue
            r, v = res[key], data["volumes"][key]
            bound = (v["weight_bytes"] + v["kv_bytes"]) / data["bandwidth"]
            step = r["wall"]
            rows.append([label, batch if batch != "prefill" else f"prefill {data['prompts']['1']}",
                         step * 1e3, bound * 1e3, bound / step,
                         *[r[p] * 1e3 for p in PHASES],
                         v["weight_bytes"] / data["bandwidth"] * 1e3,
                         v["kv_bytes"] / data["bandwidth"] * 1e3])
    return rows


def make_tables(res: dict[str, Any], data: dict[str, Any]) -> list[Table]:
    ms = [".2f"] * len(PHASES)
    account = Table(
        title=f"Where a step's time goes, {data['model']}: each phase's milliseconds",
        headers=["configuration", "batch", "step ms", "bound ms", "of bound",
                 *PHASE_HEADERS, "weights at bandwidth ms", "K/V at bandwidth ms"],
        rows=account_rows(res, data),
        formats=["", "", ".2f", ".2f", ".0%", *ms, ".2f", ".2f"],
        note=(f"{data['where']}. Batch B: B requests decoding after prompts of "
              f"{', '.join(f'{p} tokens at batch {b}' for b, p in data['prompts'].items())}; "
              f"the decode step of median time of {data['steps']}; prefill: batch 1's prompt "
              "as one step. Bound: the step's weight bytes and the K/V bytes its rows attend "
              f"over, at the highest copy bandwidth of the run ({data['bandwidth'] / 1e9:.1f} "
              "GB/s; measured before each configuration's runs in every round: "
              f"{spread_words(data['bandwidths'], 1e9)}); "
              "of bound: bound / step. Phases: Python's scheduler, sampler and the rest of "
              "the step; the graph built in Python; evaluation split by the extension's "
              "kernel clocks (wall time on MLX's stream thread, each kernel's own; thread "
              "wait: at the end of a pool job, for the other threads), MLX eval: evaluation "
              "outside those kernels. The two last columns: the weights' and the K/V's bytes "
              "at the copy bandwidth, the least the projections and attention could take. "
              f"The round of median step time of {data['rounds']}."))
    roof = Table(
        title="On the roofline: arithmetic intensity and attained rates",
        headers=["", "batch", "flops / byte", "GB/s", "of copy bandwidth", "GFLOP/s",
                 "of GEMM peak"],
        rows=roofline_rows(res, data),
        formats=["", "", ".1f", ".1f", ".0%", ".1f", ".0%"],
        note=("Each step's bytes and flops (as above) over its time, against the highest "
              f"ceilings of the run: the copy bandwidth ({data['bandwidth'] / 1e9:.1f} GB/s)"
              + (" and the float32 GEMM rate (a 1024^3 product, OpenBLAS split over every "
                 f"core: {data['peak_flops'] / 1e9:.0f} GFLOP/s; measured "
                 f"{spread_words(data['peaks'], 1e9)}). " if data["peaks"] else ". ")
              + "llama.cpp: tokens per second of its generation after the same context, "
              "its bytes those of the file and of its float16 K/V."))
    tables = [account, roof]
    if "llama.cpp|1" in res:
        tables.append(goals(res, data))
    return tables


def roofline_points(res: dict[str, Any], data: dict[str, Any]) -> list[tuple[str, Any, dict]]:
    """(label, batch, {intensity, bytes_s, flops_s}) of every measured step."""
    points = []
    for key, r in res.items():
        label, batch = key.split("|")
        v = data["volumes"][key]
        nbytes = v["weight_bytes"] + v["kv_bytes"]
        points.append((label, int(batch) if batch.isdigit() else batch,
                       {"intensity": v["flops"] / nbytes, "bytes_s": nbytes / r["wall"],
                        "flops_s": v["flops"] / r["wall"]}))
    return points


def roofline_rows(res: dict[str, Any], data: dict[str, Any]) -> list[list[Any]]:
    peak = data["peak_flops"]
    return [[label, batch, p["intensity"], p["bytes_s"] / 1e9, p["bytes_s"] / data["bandwidth"],
             p["flops_s"] / 1e9, p["flops_s"] / peak if peak else None]
            for label, batch, p in roofline_points(res, data)]


def spread_words(values: list[float], unit: float) -> str:
    """"median (lowest-highest)" of measurements, in ``unit``s."""
    lo, mid, hi = min(values) / unit, statistics.median(values) / unit, max(values) / unit
    return f"{mid:.0f} ({lo:.0f}-{hi:.0f})" if mid >= 100 else f"{mid:.1f} ({lo:.1f}-{hi:.1f})"


def goals(res: dict[str, Any], data: dict[str, Any]) -> Table:
    key = "as stored, fused|1"
    stored, llama = res[key], res["llama.cpp|1"]
    v = data["volumes"][key]
    of_bound = (v["weight_bytes"] + v["kv_bytes"]) / data["bandwidth"] / stored["wall"]
    ratio = llama["wall"] / stored["wall"]
    return goals_table("One request's decode with the weights as stored", [
        ("at 60% of the memory-bandwidth bound or more", f"{of_bound:.0%}", of_bound >= 0.6),
        ("1.5x llama.cpp's decode or more", f"{ratio:.2f}x", ratio >= 1.5)],
        note="The as stored, fused row at batch 1 of the tables above, and llama-bench's "
             "generation after the same 512-token context, side by side in this run.")


def make_figure(res: dict[str, Any], data: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = roofline_points(res, data)
    lo = min(p["intensity"] for _, _, p in points) / 2
    hi = max(p["intensity"] for _, _, p in points) * 2
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    peak = data["peak_flops"] or float("inf")
    ax.plot(xs, [min(x * data["bandwidth"], peak) for x in xs], color="black",
            label=f"copy bandwidth {data['bandwidth'] / 1e9:.0f} GB/s"
                  + (f", GEMM {peak / 1e9:.0f} GFLOP/s" if data["peak_flops"] else "")
                  + " (the run's highest)")
    markers = dict(zip([*data["configs"], "llama.cpp"], "osD^vXP*", strict=False))
    for label in markers:
        mine = [(b, p) for name, b, p in points if name == label]
        if not mine:
            continue
        ax.scatter([p["intensity"] for _, p in mine], [p["flops_s"] for _, p in mine],
                   marker=markers[label], s=50, label=label,
                   color="black" if label == "llama.cpp" else None)
        for b, p in mine:
            ax.annotate(str(b), (p["intensity"], p["flops_s"]),
                        textcoords="offset points", xytext=(5, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flops per byte of weights and K/V)")
    ax.set_ylabel("attained flops per second")
    ax.set_title(f"A step on the roofline ({data['model']}, labels: batch)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    return fig


def llama_steps(binary: Path, gguf: Path, data: dict[str, Any]) -> list[dict[str, Any]]:
    """llama.cpp's generation at each batch size after the same prompts, as one step's
    time (``wall``) and the keys a row attends over."""
    batched = binary.with_name("llama-batched-bench")
    if not batched.is_file():
        print(f"llama.cpp's batched points are not measured: {batched} is not built "
              "(`cmake --build build --target llama-batched-bench`)", flush=True)
    steps, out = data["steps"], []
    for batch in data["batches"]:
        prompt = data["prompts"][str(batch)]
        if batch == 1:
            wall = 1 / run_llama_cpp(binary, gguf, prompt, steps)["decode_tok_s"]
        elif batched.is_file():
            wall = batch / run_llama_batched(batched, gguf, prompt, steps, batch)["speed_tg"]
        else:
            continue
        out.append({"key": f"llama.cpp|{batch}", "wall": wall, "keys": prompt + (steps + 1) / 2})
    return out


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    ap.add_argument("--llama-bench", type=Path,
                    help="path of llama.cpp's llama-bench (llama-batched-bench beside it)")
    ap.add_argument("--metal-capture", type=Path, metavar="PATH.gputrace",
                    help="on a GPU, record batch 1's timed decode steps of the last round as "
                         "a Metal capture for Xcode (run with MTL_CAPTURE_ENABLED=1)")
    args = ap.parse_args()
    device = bench_device()
    if args.metal_capture is not None and device != "gpu":
        raise SystemExit("--metal-capture records a GPU's work: this run is on the "
                         f"{'CPU' if device == 'cpu' else 'CPU, in the GPU rehearsal'}")
    if args.metal_capture is not None and (args.metal_capture.suffix != ".gputrace"
                                           or args.metal_capture.exists()):
        raise SystemExit(f"--metal-capture needs a new .gputrace path: {args.metal_capture}")
    if device == "cpu":
        use_cpu()
    if args.quick and "--rounds" not in sys.argv:
        args.rounds = 1
    if args.llama_bench is None:
        print("llama.cpp is not measured: no --llama-bench PATH was given (`python "
              "benches/bench_vs_llama_cpp.py --help` says how to build it); its points "
              "and the goals are left out", flush=True)
    elif device != "cpu":
        print("llama.cpp is not measured: its comparison is of the CPU", flush=True)
        args.llama_bench = None
    float_model, tokenizer, model_name = load_model(args.quick)
    if device == "cpu":
        stored = stored_model(args.quick)
        configs = {label: (stored if c[0] else float_model, c) for label, c in
                   CPU_CONFIGS.items()}
        def ceilings() -> tuple[float, float]:
            return copy_bandwidth(), gemm_rate(split=True)
        where = "CPU, every core"
    else:  # the model as the engine loads it for the GPU, its kernels the Metal ones
        model = stored_model(args.quick) if args.quick else load(None)[0]
        configs = {GPU_CONFIG: (model, (True, True, False))}
        def ceilings() -> tuple[float, float]:
            return gpu_copy_bandwidth(), 0.0
        where = ("GPU rehearsal: the GPU's configuration run on the CPU, not a GPU's times"
                 if device == "gpu rehearsal" else "GPU (unified memory)")
    prompts = {1: 32, 4: 16} if args.quick else {1: 512, 8: 256, 32: 128}
    c = float_model.config
    weights = matmul_params(float_model)
    data: dict[str, Any] = {
        "model": model_name, "where": where, "device": device, "configs": list(configs),
        "batches": list(prompts), "prompts": {str(b): p for b, p in prompts.items()},
        "steps": args.steps, "rounds": args.rounds, "bandwidths": [], "peaks": [],
        "cores": os.cpu_count(), "matmul_weights": weights, "volumes": {}}
    model_bytes = {label: decode_bytes_per_token(dict(tree_flatten(m.parameters())),
                                                 c.vocab_size, c.tie_word_embeddings)
                   for label, (m, _) in configs.items()}
    model_bytes["llama.cpp"] = default_model_path().stat().st_size
    for model, config in configs.values():
        run_batch(model, tokenizer, config, 1, 8, 2, seed=99, kernel_clocks=False)  # warmup
    per_round: list[list[dict[str, Any]]] = []
    labels = list(configs)
    t0 = time.perf_counter()
    for r in range(args.rounds):
        measured: list[dict[str, Any]] = []
        for label in [*labels[r % len(labels):], *labels[:r % len(labels)], "llama.cpp"]:
            if label == "llama.cpp" and not args.llama_bench:
                continue
            # The ceilings just before the runs they bound: the machine's speed may drift.
            bandwidth, peak = ceilings()
            data["bandwidths"].append(bandwidth)
            if peak:
                data["peaks"].append(peak)
            if label == "llama.cpp":
                measured += llama_steps(args.llama_bench, default_model_path(), data)
                continue
            model, config = configs[label]
            for batch, prompt in prompts.items():
                capture = (args.metal_capture if batch == 1 and r == args.rounds - 1
                           else None)
                out = run_batch(model, tokenizer, config, batch, prompt, args.steps, seed=r,
                                kernel_clocks=device == "cpu", capture=capture)
                measured.append({"key": f"{label}|{batch}", **out["decode"]})
                if batch == 1:
                    measured.append({"key": f"{label}|prefill", **out["prefill"]})
                print(f"[{time.perf_counter() - t0:5.0f}s] round {r + 1}: {label}, batch "
                      f"{batch}: {out['decode']['wall'] * 1e3:.2f} ms a decode step", flush=True)
        per_round.append(measured)
    res: dict[str, Any] = {}
    for key in dict.fromkeys(m["key"] for rnd in per_round for m in rnd):
        runs = [m for rnd in per_round for m in rnd if m["key"] == key]
        res[key] = {k: v for k, v in median_step(runs).items() if k != "key"}
        res[key]["wall_rounds"] = [m["wall"] for m in runs]
    for key, r in res.items():
        label, batch = key.split("|")
        # Decode rows each attend over their own request's K/V; a prompt's rows share theirs.
        rows = prompts[1] if batch == "prefill" else int(batch)
        kv_tokens = prompts[1] if batch == "prefill" else rows * r["keys"]
        data["volumes"][key] = step_volume(model_bytes[label], weights, c, rows, r["keys"],
                                           kv_tokens, 2 if label == "llama.cpp" else 4)
    data["results"] = res
    data["bandwidth"] = max(data["bandwidths"])
    data["peak_flops"] = max(data["peaks"], default=0.0)
    data["wall_s"] = time.perf_counter() - t0
    save_results(NAME + ("_quick" if args.quick else ""), data, make_tables(res, data),
                 make_figure(res, data), rounds=args.rounds)


if __name__ == "__main__":
    main()
