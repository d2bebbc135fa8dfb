"""Week 3, Day 2: the prefill token budget, swept while a long prompt meets running decodes.

Workload (seeded): 8 requests with prompts of 16-48 random token ids start at t=0 and
generate without stopping (``ignore_eos``, a ``max_tokens`` far beyond the run). As soon as
each of them has produced ``WARM_TOKENS`` (4) tokens — they are all decoding — one long
request arrives: a prompt of ``--long-tokens`` (1,024; 512 with ``--quick``) random token ids
that then generates ``LONG_OUTPUT`` (8) tokens. The run ends when the long request
finishes; the 8 decoders are aborted then.

Configurations (``max_num_seqs=16``, dense KV, same workload): ``max_num_batched_tokens`` in
16, 32, 64, 128, 256 with chunked prefill on, and "unlimited": chunked prefill off with a
budget (4,096) larger than the long prompt, i.e. Day 1's behaviour, in which the whole
prompt is prefilled in one step. The scheduler places the decode token of every running
request first, so with budget B the long prompt advances ``B - 8`` tokens per step.

Reported per budget (medians over ``--repeats`` rounds; a round runs every budget, in
alternating order from round to round):

- TTFT p50/p99 over all 9 requests (the decoders' own prefills are chunked by the budget
  too), and the long request's TTFT (arrival to first token);
- inter-token latency (ITL) p50/p99: the wall-clock gaps between consecutive tokens of
  every request, counted for tokens that arrive after the long request does;
- max decode gap: the longest of those gaps — how long a decoding user saw nothing;
- output tok/s: all tokens generated / wall time from the first step to the long
  request's last token;
- long TTFT and max decode gap relative to "unlimited" (median of per-round ratios).

Times are ``time.perf_counter()`` taken when ``engine.step()`` returns each token. The figure
plots the trade-off: budget (log x axis) against max decode gap / ITL p99 and the long
prompt's TTFT.

OpenBLAS runs on one thread (``tiny_llm``'s default; see ``bench_week3_day1``).

    python benches/bench_week3_day2.py          # one round, ~2-5 min
    python benches/bench_week3_day2.py --repeats 2  # ~4-10 min

One round takes about 1.6 minutes of CPU time; on the shared development machine (load
average 5-10 from other jobs) it took 4-5 minutes of wall time, so a full run defaults to
one round (``--quick`` to three).
    python benches/bench_week3_day2.py --quick  # tiny random model
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from tiny_llm.engine import LLMEngine

import numpy as np
from common import Recorder, Table, greedy, load_model, percentile, save_results

BUDGETS: tuple[int | None, ...] = (16, 32, 64, 128, 256, None)  # None: unlimited, no chunking
UNLIMITED = 4096
MAX_NUM_SEQS = 16  # room for the long request next to the 8 decoders
NUM_DECODERS = 8
WARM_TOKENS = 4  # tokens each decoder has produced when the long request arrives
LONG_OUTPUT = 8
DECODER_MAX_TOKENS = 2048  # never reached: the run ends when the long request finishes


def label(budget: int | None) -> str:
    return str(budget) if budget else f"unlimited ({UNLIMITED}, no chunking)"


def workload(long_tokens: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    decoders = [
        [rng.randrange(100, 40000) for _ in range(rng.randint(16, 48))]
        for _ in range(NUM_DECODERS)
    ]
    long_prompt = [rng.randrange(100, 40000) for _ in range(long_tokens)]
    return decoders, long_prompt


def run_budget(model, tokenizer, budget, decoder_prompts, long_prompt) -> dict[str, Any]:
    engine = LLMEngine(
        model,
        tokenizer,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=budget or UNLIMITED,
        enable_chunked_prefill=budget is not None,
        scheduler="continuous",
        kv_cache="dense",
    )
    rec = Recorder(engine)
    decoders = [rec.add(p, greedy(DECODER_MAX_TOKENS)) for p in decoder_prompts]
    long_id, arrival_step, first_step = None, 0, 0
    while long_id is None or long_id not in rec.finish:
        rec.step()
        if long_id is not None and not first_step and rec.token_times[long_id]:
            first_step = engine.stats()["num_steps"]
        if long_id is None and all(len(rec.token_times[r]) >= WARM_TOKENS for r in decoders):
            long_id = rec.add(long_prompt, greedy(LONG_OUTPUT))
            arrival_step = engine.stats()["num_steps"]
    if any(r in rec.finish for r in decoders):
        raise RuntimeError("a decoder finished before the long request; raise its max_tokens")
    for r in decoders:
        engine.abort(r)

    t_long = rec.arrival[long_id]
    first_long = rec.token_times[long_id][0]
    gaps = [
        b - a
        for r in [*decoders, long_id]
        for a, b in zip(rec.token_times[r], rec.token_times[r][1:], strict=False)
        if b > t_long
    ]
    ttft = rec.ttft()
    steps = engine.stats()["num_steps"]
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "long_ttft_s": first_long - t_long,
        "long_prefill_steps": first_step - arrival_step,
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "max_decode_gap_s": max(gaps),
        "output_tokens": rec.num_tokens(),
        "tok_per_s": rec.num_tokens() / rec.wall,
        "steps": steps,
        "arrival_step": arrival_step,
        "wall_s": rec.wall,
    }


def plot(summary: dict[str, dict], long_tokens: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_unlimited = 2 ** int(np.ceil(np.log2(max(b for b in BUDGETS if b) * 4)))
    xs = [b or x_unlimited for b in BUDGETS]
    rows = [summary[label(b)] for b in BUDGETS]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot(xs, [r["itl_p99_s"] for r in rows], "s-", color="tab:orange", markersize=9,
            linewidth=3, label="ITL p99 (left)")
    ax.plot(xs, [r["max_decode_gap_s"] for r in rows], "o--", color="tab:red",
            label="max decode gap (left)")
    ax.plot(xs, [r["itl_p50_s"] for r in rows], "^:", color="tab:olive",
            label="ITL p50 (left)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(b) if b else "∞\n(no chunking)" for b in BUDGETS])
    ax.set_xlabel("max_num_batched_tokens (token budget per step)")
    ax.set_ylabel("decode latency (s)")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(xs, [r["long_ttft_s"] for r in rows], "D-", color="tab:blue",
             label="long prompt TTFT (right)")
    ax2.set_ylabel(f"TTFT of the {long_tokens}-token prompt (s)")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper center", fontsize=9)
    ax.set_title(
        f"Chunked prefill budget: a {long_tokens}-token prompt arrives while "
        f"{NUM_DECODERS} requests decode",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, 512-token prompt")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 1; quick: 3)")
    ap.add_argument("--long-tokens", type=int, default=None, help="default 1024 (quick: 512)")
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 1)
    long_tokens = args.long_tokens or (512 if args.quick else 1024)
    if long_tokens >= UNLIMITED:
        ap.error(f"--long-tokens must be below the unlimited budget ({UNLIMITED})")
    t_start = time.perf_counter()

    model, tokenizer, model_name = load_model(args.quick)
    decoder_prompts, long_prompt = workload(long_tokens)
    for budget in (64, None):  # warmup: chunked and one-shot prefill paths
        run_budget(model, tokenizer, budget, decoder_prompts, long_prompt[:128])

    rounds: list[dict[str, dict]] = []
    for r in range(repeats):
        order = BUDGETS if r % 2 == 0 else BUDGETS[::-1]
        result = {}
        for budget in order:
            m = run_budget(model, tokenizer, budget, decoder_prompts, long_prompt)
            result[label(budget)] = m
            print(f"round {r + 1}/{repeats} budget {label(budget):>8}: {m['steps']} steps, "
                  f"{m['wall_s']:.1f} s, long TTFT {m['long_ttft_s']:.2f} s, "
                  f"max gap {m['max_decode_gap_s']:.2f} s", flush=True)
        rounds.append(result)

    keys = list(rounds[0][label(None)])
    summary = {
        label(b): {k: statistics.median(rnd[label(b)][k] for rnd in rounds) for k in keys}
        for b in BUDGETS
    }

    def vs_unlimited(budget: int | None, key: str) -> float:
        return statistics.median(rnd[label(budget)][key] / rnd[label(None)][key]
                                 for rnd in rounds)

    rows = []
    for b in BUDGETS:
        s = summary[label(b)]
        rows.append([
            label(b), s["ttft_p50_s"], s["ttft_p99_s"], s["long_ttft_s"],
            s["long_prefill_steps"], s["itl_p50_s"], s["itl_p99_s"], s["max_decode_gap_s"],
            s["tok_per_s"], vs_unlimited(b, "long_ttft_s"), vs_unlimited(b, "max_decode_gap_s"),
        ])
    tables = [
        Table(
            f"Prefill budget sweep: a {long_tokens}-token prompt arrives while "
            f"{NUM_DECODERS} requests decode, {model_name}",
            ["budget", "TTFT p50 (s)", "TTFT p99 (s)", "long TTFT (s)", "long prefill steps",
             "ITL p50 (s)", "ITL p99 (s)", "max decode gap (s)", "output tok/s",
             "long TTFT vs unlimited", "max gap vs unlimited"],
            rows,
            ["", ".2f", ".2f", ".2f", ".0f", ".3f", ".3f", ".2f", ".1f", ".2f", ".2f"],
            note=(
                f"max_num_seqs={MAX_NUM_SEQS}, dense KV, continuous scheduler; decoders' "
                f"prompts 16-48 tokens; the long request arrives once every decoder has "
                f"{WARM_TOKENS} tokens and generates {LONG_OUTPUT}. TTFT over all "
                f"{NUM_DECODERS + 1} requests; ITL and max gap over token gaps ending after the "
                f"long request's arrival. Medians of {repeats} round(s); the ratio columns "
                "are medians of per-round ratios to the unlimited budget."
            ),
        )
    ]
    data = {
        "model": model_name,
        "quick": args.quick,
        "repeats": repeats,
        "config": {"max_num_seqs": MAX_NUM_SEQS, "kv_cache": "dense",
                   "scheduler": "continuous", "unlimited_budget": UNLIMITED},
        "workload": {"decoder_prompt_lens": [len(p) for p in decoder_prompts],
                     "long_prompt_len": long_tokens, "long_output_tokens": LONG_OUTPUT,
                     "warm_tokens": WARM_TOKENS},
        "budgets": [b or UNLIMITED for b in BUDGETS],
        "rounds": rounds,
        "summary": summary,
        "bench_wall_s": None,
    }
    fig = plot(summary, long_tokens)
    data["bench_wall_s"] = time.perf_counter() - t_start
    save_results("bench_week3_day2" + ("_quick" if args.quick else ""), data, tables, fig)
    print(f"bench wall time {data['bench_wall_s']:.0f} s")


if __name__ == "__main__":
    main()
