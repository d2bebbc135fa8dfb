"""Tensor parallelism on this machine, and on paper on Macs linked by Thunderbolt or Ethernet.

**Measured here** (table 1). A random float32 model shaped like SmolLM2-135M (30 layers,
hidden 576, MLP 1536, tied embedding) but with 12 query and 6 KV heads of 48, so that 1, 2
and 3 ranks all divide it (SmolLM2's own 3 KV heads allow 1 and 3 only). Each rank is a
process with one thread of the extension's kernels (``tiny_llm.testing.ranks``, as
``mlx.launch -n N --backend ring`` starts them, over 127.0.0.1), so 3 ranks share this
machine's cores when it has 2. For 1, 2 and 3 ranks and batches of 1 and 8 decoding
requests (16-token prompts), per decode step:

- the step's time (median of ``--steps`` decode steps, after the prefill and a warmup);
- the communication: the step's ``2 x layers`` all-reduces of its ``[batch, hidden]``
  partial sums, timed alone on the same ranks just before (``tensor_parallel.all_reduce``:
  gather, then add in rank order), and MLX's ring ``all_sum`` of the same arrays for
  comparison; compute is the step minus that communication;
- the bytes each rank receives per step (``(N - 1) x rows x hidden x 4`` per all-reduce);
- mlx-lm's sharded generation of one request on the same ranks and weights (``Model.shard``:
  its all_sum after o_proj and down_proj, driven by ``generate_step``), its decode tok/s
  and whether its greedy tokens equal ours.

At 1 rank our engine runs its fused decode layers; with more it cannot (the fused op has
no place for the all-reduces) and runs layer by layer. Every configuration is a fresh set
of processes; rounds interleave them (``--rounds``, median reported).

**On paper** (table 2): a Qwen3-32B-class dense model (64 layers, hidden 5120, 32.8 B
parameters) decoding one request on Macs with 546 GB/s of memory bandwidth (an M4 Max,
Apple's figure), 64 GB each: bfloat16 weights (65.6 GB: they fit two Macs, not one) and
4-bit ones (about 4.5 bits with scales). A decode step is bound by reading the weights
(``weight bytes / N / bandwidth``, at full bandwidth: an upper bound) plus ``2 x 64``
all-reduces of one bfloat16 row, each a ring of ``2 (N - 1)`` messages of ``1/N`` of the
row: ``latency + bytes / link bandwidth`` each. The links' figures are public ones:
Thunderbolt 5's RDMA (macOS 26.2's InfiniBand verbs, MLX's JACCL backend) about 7 µs one
way and about 6 GB/s sustained per direction (reported ``ib_write_lat``/``ib_write_bw``
figures; users report 5-9 µs); TCP over a Thunderbolt bridge about 65 µs; 10 GbE 1.25 GB/s,
with TCP's latency taken as 50 µs (a typical figure, not a measurement). Pipeline
parallelism, for comparison, splits the layers instead: one request's token crosses the
``N - 1`` links once each, but every stage waits for the one before it, so one request
decodes no faster than on one Mac (it pays only with ``N`` requests in flight).

    python benches/bench_tensor_parallel.py            # about 5 minutes on 2 cores
    python benches/bench_tensor_parallel.py --quick    # a tiny model, one round
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiny_llm.kernels.cpu_kernels import kernels_available

from common import REPO_ROOT, Table, bench_parser, save_results, spread

SIZES = (1, 2, 3)
# Our engine's configurations: its default at every size, and 1 rank with the decode layers
# run one by one as they must be across ranks.
CONFIGS = (("ours", 1), ("ours_by_layer", 1), ("ours", 2), ("ours", 3))
BATCHES = (1, 8)
PROMPT = 16
MODEL = dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
             intermediate_size=1536, num_attention_heads=12, num_key_value_heads=6,
             head_dim=48, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
             max_position_embeddings=8192)
QUICK_MODEL = dict(MODEL, hidden_size=96, num_hidden_layers=2, intermediate_size=192,
                   head_dim=8)

# The model on paper: a Qwen3-32B-class dense model, and the Mac and links it runs on.
PAPER = dict(layers=64, hidden=5120, params=32.8e9, mac_bandwidth=546e9, mac_memory=64e9)
PAPER_WEIGHTS = {"bfloat16": 2.0, "4-bit": 4.5 / 8}  # bytes per parameter
LINKS = {  # name: (one-way latency in seconds, bandwidth per direction in bytes/s)
    "Thunderbolt 5, RDMA": (7e-6, 6e9),
    "Thunderbolt 5, TCP": (65e-6, 2.5e9),
    "10 GbE, TCP": (50e-6, 1.25e9),
}


def build(quick: bool):
    """The benchmark's model (the same random weights in every process) and tokenizer."""
    from tiny_llm import Model, ModelConfig, Tokenizer, default_model_path
    from tiny_llm.testing.models import random_weights

    import mlx.core as mx

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    model = Model(ModelConfig.from_hf(QUICK_MODEL if quick else MODEL))
    model.load_weights(random_weights(model, seed=0))
    mx.eval(model.parameters())
    return model, Tokenizer.from_gguf_metadata(meta)


def prompts(batch: int) -> list[list[int]]:
    return [[100 + 37 * b + 11 * i for i in range(PROMPT)] for b in range(batch)]


def time_all_reduces(group, rows: int, hidden: int, layers: int, repeats: int = 5
                     ) -> dict[str, float]:
    """Seconds for one step's ``2 x layers`` all-reduces of ``[rows, hidden]``: ours and
    MLX's ring all_sum (every rank runs this, in step)."""
    from tiny_llm.tensor_parallel import all_reduce

    import mlx.core as mx

    x = mx.random.normal((rows, hidden))
    mx.eval(x)
    out = {}
    for name, reduce in (("ours", lambda a: all_reduce(a, group)),
                         ("all_sum", lambda a: mx.distributed.all_sum(a, group=group))):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for _ in range(2 * layers):
                mx.eval(reduce(x))
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[1:])
    return out


def run_ours(size: int, quick: bool, steps: int, fused: bool = True) -> dict | None:
    """One rank of our engine: rank 0 returns what it measured; a worker never returns."""
    from tiny_llm import LLMEngine, SamplingParams, reference_extension
    from tiny_llm.distributed.ring import join

    reference_extension().set_num_threads(1)
    model, tokenizer = build(quick)
    config = model.config
    comm = {}
    if size > 1:
        group = join(size).group
        comm = {b: time_all_reduces(group, b, config.hidden_size, config.num_hidden_layers)
                for b in BATCHES}
    engine = LLMEngine(model, tokenizer, tensor_parallel_size=size, num_pages=256,
                       max_num_seqs=max(BATCHES), fused_layers=fused)
    result = {"comm": comm, "steps": {}, "tokens": None}
    for batch in BATCHES:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts(batch)]
        times, tokens = [], {i: [] for i in ids}
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - start)
            for out in outs:
                tokens[out.request_id] += out.outputs[0].token_ids[len(tokens[out.request_id]):]
        result["steps"][batch] = statistics.median(times[3:])  # past prefill and warmup
        if batch == 1:
            result["tokens"] = tokens[ids[0]]
    return result


def run_mlx_lm(size: int, quick: bool, steps: int) -> dict:
    """One rank of mlx-lm's sharded generation of one request (every rank generates)."""
    import mlx.core as mx
    from common import mlx_lm_model
    from mlx_lm.generate import generate_step

    model, _ = build(quick)
    ref = mlx_lm_model(model)
    if size > 1:
        ref.shard(mx.distributed.init(strict=True, backend="ring"))
        mx.eval(ref.parameters())
    times, tokens = [], []
    start = time.perf_counter()
    for token, _ in generate_step(mx.array(prompts(1)[0]), ref, max_tokens=steps + 4,
                                  sampler=lambda logits: mx.argmax(logits, axis=-1)):
        times.append(time.perf_counter() - start)
        tokens.append(int(token))
        start = time.perf_counter()
    return {"step": statistics.median(times[3:]), "tokens": tokens}


def rank_main(kind: str, size: int, quick: bool, steps: int, out: Path) -> None:
    import os

    if kind == "mlx_lm":
        result = run_mlx_lm(size, quick, steps)
    else:
        result = run_ours(size, quick, steps, fused=kind == "ours")

    if os.environ.get("MLX_RANK", "0") == "0":
        out.write_text(json.dumps(result))


def launch(kind: str, size: int, quick: bool, steps: int) -> dict:
    """``size`` ranks of this script in the role ``kind``; rank 0's result."""
    from tiny_llm.testing.ranks import LocalRanks

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [str(Path(__file__)), "--rank", kind, str(size), str(steps), str(out)]
        argv += ["--quick"] if quick else []
        if size == 1:
            subprocess.run([sys.executable, *argv], check=True, cwd=REPO_ROOT)
        else:
            ranks = LocalRanks(size, argv, Path(tmp))
            codes = ranks.wait(900)
            if codes != [0] * size:
                raise SystemExit(f"{kind} on {size} ranks failed: {codes}\n"
                                 f"{ranks.output(0)[-3000:]}")
        return json.loads(out.read_text())


def median_of(rounds: list[dict], key: tuple[str, int], *path: str) -> float:
    """The median over rounds of ``result[key][path...]`` (0 where a path is absent)."""
    values = []
    for r in rounds:
        value = r[key]
        for step in path:
            value = value.get(step, {}) if isinstance(value, dict) else value
        values.append(value if isinstance(value, float | int) else 0.0)
    return statistics.median(values)


def measured_table(rounds: list[dict], hidden: int, layers: int) -> Table:
    rows = []
    for kind, size in CONFIGS:
        for batch in BATCHES:
            b = str(batch)
            step = median_of(rounds, (kind, size), "steps", b)
            comm = median_of(rounds, (kind, size), "comm", b, "ours")
            ring = median_of(rounds, (kind, size), "comm", b, "all_sum")
            received = 2 * layers * (size - 1) * batch * hidden * 4
            mlx = equal = None
            if batch == 1:
                mlx = median_of(rounds, ("mlx_lm", size), "step")
                same = all(r["mlx_lm", size]["tokens"] == r[kind, size]["tokens"] for r in rounds)
                equal = "yes" if same else "no"
            fused = kind == "ours" and size == 1 and kernels_available()  # none on a GPU
            layers_run = "fused" if fused else "one by one"
            compute = max(0.0, step - comm)  # 0: the all-reduces alone outlasted the step
            rows.append([size, layers_run, batch, step * 1e3, comm * 1e3, compute * 1e3,
                         min(100.0, comm / step * 100), ring * 1e3, received / 1e3, batch / step,
                         None if mlx is None else 1 / mlx,
                         None if mlx is None else mlx / step, equal])
    return Table(
        "Decode steps split over ranks on this machine "
        + ("(one kernel thread per rank)" if kernels_available() else "(MLX's operations)"),
        ["ranks", "decode layers", "batch", "step ms", "all-reduces ms", "compute ms",
         "communication %", "ring all_sum ms", "KB received per rank", "tok/s",
         "mlx-lm tok/s", "ours / mlx-lm", "same tokens as mlx-lm"],
        rows, formats=["", "", "", ".1f", ".1f", ".1f", ".0f", ".1f", ".0f", ".1f", ".1f", ".2f",
                       ""],
        note="all-reduces: the step's 2 x layers all-reduces of its rows timed alone on the "
             "same ranks (ours: gather, add in rank order); ring all_sum: MLX's, for the same "
             "arrays; compute: the step minus our all-reduces (0 where those, timed alone, "
             "outlasted the step: ranks that share cores wait for each other). mlx-lm: one "
             "request, "
             "generate_step on its Model.shard. Decode layers: our engine's default at 1 rank "
             "runs them fused; across ranks it cannot, and runs them one by one (as the "
             "second row of 1 rank does).")


def paper_table() -> Table:
    rows = []
    hidden, layers = PAPER["hidden"], PAPER["layers"]
    for weights, bytes_per_param in PAPER_WEIGHTS.items():
        total = PAPER["params"] * bytes_per_param
        for link, (latency, bandwidth) in LINKS.items():
            for n in (2, 4):
                compute = total / n / PAPER["mac_bandwidth"]
                message = hidden * 2 / n  # bfloat16 row, a ring step carries 1/N of it
                comm = 2 * layers * 2 * (n - 1) * (latency + message / bandwidth)
                one_mac = total / PAPER["mac_bandwidth"]
                pipeline = one_mac + (n - 1) * (latency + hidden * 2 / bandwidth)
                rows.append([weights, link, n, latency * 1e6, compute * 1e3, comm * 1e3,
                             comm / (compute + comm) * 100, 1 / (compute + comm), 1 / pipeline,
                             "yes" if total <= PAPER["mac_memory"] else "no"])
    return Table(
        "On paper: one request of a 32 B dense model on 2 and 4 Macs (546 GB/s each)",
        ["weights", "link", "Macs", "latency µs", "weights ms", "all-reduces ms",
         "communication %", "tensor parallel tok/s", "pipeline tok/s", "fits one Mac"],
        rows, formats=["", "", "", ".0f", ".1f", ".1f", ".0f", ".1f", ".1f", ""],
        note="Decode at full memory bandwidth (an upper bound); 2 x 64 ring all-reduces of one "
             "bfloat16 row per token. Pipeline: the layers split over the Macs, one request "
             "crossing each link once per token. The figures are the docstring's.")


def figure(table: Table):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r[0]} rank{'s' if r[0] > 1 else ''}, {r[1]}\nbatch {r[2]}" for r in table.rows]
    compute = [r[5] for r in table.rows]
    comm = [r[4] for r in table.rows]
    ax.bar(labels, compute, label="compute")
    ax.bar(labels, comm, bottom=compute, label="all-reduces")
    ax.set_ylabel("ms per decode step")
    ax.set_title("Where a decode step's time goes, by ranks (this machine)")
    ax.legend()
    return fig


def main() -> None:
    if "--rank" in sys.argv:  # one rank of one configuration
        i = sys.argv.index("--rank")
        kind, size, steps, out = sys.argv[i + 1 : i + 5]
        rank_main(kind, int(size), "--quick" in sys.argv, int(steps), Path(out))
        return
    ap = bench_parser(__doc__)
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 24)")
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 24)
    rounds_n = 1 if args.quick and args.rounds == 3 else args.rounds
    model = QUICK_MODEL if args.quick else MODEL
    rounds = []
    for r in range(rounds_n):
        order = [*CONFIGS, *(("mlx_lm", size) for size in SIZES)]
        result = {}
        for kind, size in (order if r % 2 == 0 else order[::-1]):
            print(f"round {r + 1}: {kind} on {size} rank(s)", flush=True)
            result[kind, size] = launch(kind, size, args.quick, steps)
        rounds.append(result)
    table = measured_table(rounds, model["hidden_size"], model["num_hidden_layers"])
    data = {"rounds": [{f"{k}@{s}": v for (k, s), v in r.items()} for r in rounds],
            "model": model, "steps": steps,
            "step_ms": {f"{k}@{s}x{b}": spread([r[k, s]["steps"][str(b)] * 1e3 for r in rounds])
                        for k, s in CONFIGS for b in BATCHES}}
    save_results("bench_tensor_parallel" + ("_quick" if args.quick else ""), data,
                 [table, paper_table()], figure(table), rounds=rounds_n)


if __name__ == "__main__":
    main()
