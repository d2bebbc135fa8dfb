"""Week 3, Day 1: static vs continuous batching, side by side on one mixed workload.

Workload (``--requests`` 32, seeded): prompts of 16-96 random token ids; output lengths
skewed — seven in eight requests want 4-16 tokens, one in eight wants 64-96 — fixed with
``max_tokens`` and ``ignore_eos=True``, so both policies generate exactly the same tokens.
Every request arrives at t=0, in the same order, into an engine with ``max_num_seqs=8``.

Day 1 predates chunked prefill, so both engines run with ``enable_chunked_prefill=False``
and a token budget (4096) that never binds: a prompt is prefilled whole in its admission
step, and that step also samples its first token. The only difference between the two
engines is ``scheduler="static"`` (admit only when the whole previous batch has finished)
vs ``"continuous"`` (admit whenever a slot is free).

What is reported, per policy (median over ``--rounds`` rounds, default 3, with the min and
max across rounds; the two policies alternate within a round, in alternating order, so a
noisy neighbour hurts both alike):

- output tok/s: generated tokens / wall time from the first ``engine.step()`` to the last;
- steps: ``engine.stats()["num_steps"]``, next to the model-free prediction of
  ``static_batching_steps`` / ``continuous_batching_steps`` for the same output lengths
  (the prediction assumes one-token prompts; with prefill in the admission step and a
  budget that never binds, the engine should take exactly as many steps);
- wasted slot-steps: summed over steps, the slots (of ``max_num_seqs``) that did not hold a
  request producing a token in that step — the prediction's definition;
- request latency p50/p99 (arrival to last token) and TTFT p50 (arrival to first token),
  from ``time.perf_counter()`` taken when ``engine.step()`` returns the token;
- the ratios continuous / static, computed within each round, median over rounds.

The figure is the slot-occupancy timeline of both policies (x: step, y: slot of the dense
KV cache, read from ``engine.kv.slot_of``; colour: request; white: idle slot).

OpenBLAS runs on one thread (``tiny_llm``'s default unless ``OPENBLAS_NUM_THREADS`` is set):
with two threads on a shared 2-core machine, a busy neighbour makes its spinning threads
5-10x slower and very noisy.

    python benches/bench_week3_day1.py          # ~3-4 minutes on 2 cores
    python benches/bench_week3_day1.py --quick  # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from tiny_llm import LLMEngine
from tiny_llm.day1_batching import continuous_batching_steps, static_batching_steps

import numpy as np
from common import (
    Recorder,
    Table,
    bench_parser,
    greedy,
    load_model,
    percentile,
    save_results,
    spread,
)

POLICIES = ("static", "continuous")
MAX_NUM_SEQS = 8
BUDGET = 4096  # never binds: 8 prompts of at most 96 tokens, plus decodes


def workload(n: int, quick: bool, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    n_long = max(1, n // 8)
    lo, hi = (16, 32) if quick else (64, 96)
    out = [rng.randint(4, 16) for _ in range(n - n_long)] + [
        rng.randint(lo, hi) for _ in range(n_long)
    ]
    rng.shuffle(out)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 96))] for _ in range(n)]
    return prompts, out


def make_engine(model, tokenizer, policy: str) -> LLMEngine:
    return LLMEngine(
        model,
        tokenizer,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        scheduler=policy,
        enable_chunked_prefill=False,
        kv_cache="dense",
    )


def run_policy(model, tokenizer, policy, prompts, out_lens) -> tuple[dict[str, Any], Recorder]:
    engine = make_engine(model, tokenizer, policy)
    rec = Recorder(engine)
    for prompt, n in zip(prompts, out_lens, strict=True):
        rec.add(prompt, greedy(n))
    while engine.has_unfinished_requests():
        rec.step()
    steps = engine.stats()["num_steps"]
    produced = [len(s) for s in rec.step_slots]
    metrics = {
        "wall_s": rec.wall,
        "output_tokens": rec.num_tokens(),
        "tok_per_s": rec.num_tokens() / rec.wall,
        "steps": steps,
        "ms_per_step": 1000 * rec.wall / steps,
        "wasted_slot_steps": sum(MAX_NUM_SEQS - p for p in produced),
        "latency_p50_s": percentile(rec.latency(), 50),
        "latency_p99_s": percentile(rec.latency(), 99),
        "ttft_p50_s": percentile(rec.ttft(), 50),
    }
    assert metrics["output_tokens"] == sum(out_lens), "a request produced the wrong length"
    return metrics, rec


def timeline(rec: Recorder, order: list[str]) -> np.ndarray:
    """[slots, steps] of request index (NaN: idle)."""
    index = {rid: i for i, rid in enumerate(order)}
    grid = np.full((MAX_NUM_SEQS, len(rec.step_slots)), np.nan)
    for t, slots in enumerate(rec.step_slots):
        for slot, rid in slots.items():
            grid[slot, t] = index[rid]
    return grid


def plot(recs: dict[str, Recorder], runs: dict[str, dict], out_lens: list[int]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    n = len(out_lens)
    if n <= 40:
        colors = np.concatenate([plt.get_cmap(c)(np.arange(20)) for c in ("tab20", "tab20b")])
    else:
        colors = plt.get_cmap("hsv")(np.linspace(0, 1, n, endpoint=False))
    colors = colors[np.random.default_rng(0).permutation(n)]  # neighbours differ in colour
    cmap = ListedColormap(colors)
    cmap.set_bad("white")
    width = max(len(r.step_slots) for r in recs.values())
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.5), sharex=True)
    for ax, policy in zip(axes, POLICIES, strict=True):
        rec = recs[policy]
        grid = np.ma.masked_invalid(timeline(rec, list(rec.arrival)))
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5,
                  vmax=n - 0.5, extent=(-0.5, grid.shape[1] - 0.5, MAX_NUM_SEQS - 0.5, -0.5))
        m = runs[policy]
        ax.set_title(
            f"{policy}: {m['steps']:.0f} steps, {m['wasted_slot_steps']:.0f} wasted slot-steps, "
            f"{m['tok_per_s']:.1f} tok/s, latency p50 {m['latency_p50_s']:.1f} s",
            fontsize=10,
        )
        ax.set_ylabel("slot")
        ax.set_yticks(range(MAX_NUM_SEQS))
        ax.set_xlim(-0.5, width - 0.5)
    axes[-1].set_xlabel("engine step")
    fig.suptitle(
        f"Slot occupancy, {n} requests arriving at t=0, max_num_seqs={MAX_NUM_SEQS} "
        f"(colour = request, white = idle slot)",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests (default 32; quick: 16)")
    args = ap.parse_args()
    repeats = args.rounds
    t_start = time.perf_counter()

    model, tokenizer, model_name = load_model(args.quick)
    prompts, out_lens = workload(args.requests or (16 if args.quick else 32), args.quick)
    predicted = {
        "static": static_batching_steps(out_lens, MAX_NUM_SEQS),
        "continuous": continuous_batching_steps(out_lens, MAX_NUM_SEQS),
    }

    for policy in POLICIES:  # warmup: one small run each
        run_policy(model, tokenizer, policy, prompts[:MAX_NUM_SEQS], [3] * MAX_NUM_SEQS)

    rounds: list[dict[str, dict]] = []
    recs: dict[str, Recorder] = {}
    for r in range(repeats):
        order = POLICIES if r % 2 == 0 else POLICIES[::-1]
        result = {}
        for policy in order:
            result[policy], recs[policy] = run_policy(model, tokenizer, policy, prompts, out_lens)
            m = result[policy]
            print(f"round {r + 1}/{repeats} {policy:>10}: {m['steps']} steps, "
                  f"{m['wall_s']:.1f} s, {m['tok_per_s']:.1f} tok/s", flush=True)
        rounds.append(result)

    def med(policy: str, key: str) -> float:
        return statistics.median(rnd[policy][key] for rnd in rounds)

    keys = list(rounds[0]["static"])
    summary = {p: {k: med(p, k) for k in keys} for p in POLICIES}
    spreads = {p: {k: spread([rnd[p][k] for rnd in rounds]) for k in keys} for p in POLICIES}
    ratios = {k: spread([rnd["continuous"][k] / rnd["static"][k] for rnd in rounds])
              for k in keys}

    def ratio(key: str) -> float:
        return ratios[key]["median"]
    policy_rows = []
    for p in POLICIES:
        s = summary[p]
        tps = spreads[p]["tok_per_s"]
        policy_rows.append([
            p, s["tok_per_s"], tps["min"], tps["max"], s["steps"], predicted[p].steps,
            s["wasted_slot_steps"],
            predicted[p].wasted_slot_steps, s["ms_per_step"], s["latency_p50_s"],
            s["latency_p99_s"], s["ttft_p50_s"], s["wall_s"],
        ])
    n_long = sum(n > 16 for n in out_lens)
    tables = [
        Table(
            f"Static vs continuous batching: {len(out_lens)} requests at t=0, "
            f"max_num_seqs={MAX_NUM_SEQS}, {model_name}",
            ["policy", "output tok/s", "min", "max", "steps", "predicted steps",
             "wasted slot-steps", "predicted wasted", "ms/step", "latency p50 (s)",
             "latency p99 (s)", "TTFT p50 (s)", "wall (s)"],
            policy_rows,
            ["", ".1f", ".1f", ".1f", ".0f", "", ".0f", "", ".0f", ".2f", ".2f", ".2f", ".1f"],
            note=(
                f"Output lengths {min(out_lens)}-{max(out_lens)} tokens ({n_long} long), "
                f"{sum(out_lens)} in all; prompts 16-96 tokens. Chunked prefill off, budget "
                f"{BUDGET} (never binds), dense KV. Predicted = model-free "
                "`static_batching_steps` / `continuous_batching_steps`. Medians of "
                f"{repeats} interleaved round(s); min and max of output tok/s across rounds."
            ),
        ),
        Table(
            "Continuous relative to static (median of per-round ratios)",
            ["output tok/s", "steps", "latency p50", "latency p99", "TTFT p50",
             "ms/step"],
            [[ratio("tok_per_s"), ratio("steps"), ratio("latency_p50_s"),
              ratio("latency_p99_s"), ratio("ttft_p50_s"), ratio("ms_per_step")]],
            [".2f", ".2f", ".2f", ".2f", ".2f", ".2f"],
            note="Values are continuous / static: above 1 for tok/s is a gain; below 1 for "
            "steps, latencies and TTFT is a gain. Each is the median of the rounds' own ratios "
            "(continuous and static side by side in one round), so it need not equal the "
            "ratio of table 1's medians.",
        ),
    ]
    data = {
        "model": model_name,
        "quick": args.quick,
        "config": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": BUDGET,
                   "enable_chunked_prefill": False, "kv_cache": "dense"},
        "workload": {"prompt_lens": [len(p) for p in prompts], "output_lens": out_lens,
                     "arrival": "all at t=0, in list order"},
        "predicted": {p: vars(predicted[p]) for p in POLICIES},
        "rounds": rounds,
        "summary": summary,
        "spread": spreads,
        "continuous_over_static": ratios,
        "timeline": {p: [{str(k): v for k, v in s.items()} for s in recs[p].step_slots]
                     for p in POLICIES},
        "bench_wall_s": None,
    }
    fig = plot(recs, summary, out_lens)
    data["bench_wall_s"] = time.perf_counter() - t_start
    save_results("bench_week3_day1" + ("_quick" if args.quick else ""), data, tables, fig,
                 rounds=repeats)
    print(f"bench wall time {data['bench_wall_s']:.0f} s")


if __name__ == "__main__":
    main()
