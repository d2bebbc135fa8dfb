"""Week 3, Day 2: the prefill token budget, swept while a long prompt meets running decodes,
and fairness between prompts (``long_prefill_token_threshold``).

Two measurements on the dense-KV engine (``kv_cache="dense"``, continuous scheduler,
``max_num_seqs=16``), each with a fixed workload: every request generates a fixed number of
tokens (``max_tokens`` with ``ignore_eos``), so every configuration of a table computes the
same tokens and its output tok/s can be compared *within that table* (the two tables serve
different workloads: never compare tok/s across them).

1. **Budget sweep.** 8 requests with prompts of 16-48 random token ids start at t=0. As
   soon as each has produced ``WARM_TOKENS`` (4) tokens, one long request arrives: a prompt
   of ``--long-tokens`` (1,024; 256 with ``--quick``) random token ids that generates
   ``LONG_OUTPUT`` (8) tokens. The 8 decoders generate enough tokens (``decoder_tokens``) to
   still be decoding when the long request finishes at the smallest budget; the run ends
   when every request has finished. Configurations: ``max_num_batched_tokens`` in 16, 32,
   64, 128, 256 with chunked prefill on, and "unlimited": chunked prefill off with a budget
   (4,096) larger than the long prompt, i.e. Day 1's behaviour, the whole prompt prefilled
   in one step. Decodes are placed first, so with budget B the long prompt advances
   ``B - 8`` tokens per step.

   Reported per budget: TTFT p50/p99 over all 9 requests; the long request's TTFT and its
   prefill steps; inter-token latency (ITL) p50/p99 and the max decode gap over the gaps
   between consecutive tokens that end while the long request is in the system (from its
   arrival to its last token); output tok/s (all tokens / wall time of the run); long TTFT
   and max decode gap relative to "unlimited" (median of per-round ratios); and the
   attention scores the long prompt's steps computed, relative to one step's: the dense
   path multiplies a step's T rows by all S keys of the sequence and masks the product
   (``causal_attention``), so a chunk of ``c`` rows ending at position ``e`` computes
   ``c × e`` scores per head and layer, and the whole prompt in one step ``n × n``.

2. **Fairness between prompts.** 4 decoders run (prompts 16-48 tokens); once each has 4
   tokens, a burst arrives at once, in this order: a long prompt (``--fair-long-tokens``,
   512; 128 with ``--quick``) and two short ones (16-32 tokens), three times (3 long, 6
   short), each generating ``FAIR_OUTPUT`` (8) tokens. Budgets 64, 128 and 256, each with
   ``long_prefill_token_threshold`` off (the oldest prompt takes what the step has left, so
   the shorts wait behind a long prompt) and on (``budget // 4``: no prompt takes more than
   a quarter of a step). Reported: TTFT p50 and max of the short requests and of the long
   ones, the max inter-token gap of the running decoders after the burst (every
   configuration has the same number of such gaps), output tok/s (same workload in every
   row), and the short requests' TTFT with the threshold on / off at the same budget.

Every configuration of both tables runs once per round; a round runs them in an order that
alternates from round to round; ``--rounds`` (default 3) rounds, medians reported (the JSON
has min, max and every round's value). Times are ``time.perf_counter()`` taken when
``engine.step()`` returns each token.

OpenBLAS runs on one thread (``tiny_llm``'s default; see ``bench_week3_day1``).

    python benches/bench_week3_day2.py           # about 20 minutes on 2 cores (3 rounds)
    python benches/bench_week3_day2.py --quick   # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from tiny_llm import LLMEngine

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

BUDGETS: tuple[int | None, ...] = (16, 32, 64, 128, 256, None)  # None: unlimited, no chunking
UNLIMITED = 4096
MAX_NUM_SEQS = 16  # room for the long request next to the 8 decoders (and the burst)
NUM_DECODERS = 8
WARM_TOKENS = 4  # tokens each decoder has produced when the long request arrives
LONG_OUTPUT = 8

FAIR_BUDGETS = (64, 128, 256)
FAIR_DECODERS = 4
FAIR_NUM_LONG = 3
FAIR_SHORTS_PER_LONG = 2
FAIR_SHORT = (16, 32)
FAIR_OUTPUT = 8


def label(budget: int | None) -> str:
    return str(budget) if budget else f"unlimited ({UNLIMITED}, no chunking)"


def fair_label(budget: int, threshold: bool) -> str:
    return f"{budget}, threshold {'on' if threshold else 'off'}"


def fair_threshold(budget: int) -> int:
    return budget // 4


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def decoder_prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [random_prompt(rng, rng.randint(16, 48)) for _ in range(n)]


def run_engine(model, tokenizer, budget: int | None, threshold: int | None,
               decoders: list[list[int]], decoder_tokens: int,
               burst: list[tuple[list[int], int]]) -> tuple[Recorder, list[str], list[str],
                                                            dict[str, int], dict[str, int]]:
    """Start the decoders; once each has ``WARM_TOKENS`` tokens add the ``burst`` (prompt,
    max_tokens) at once; step until every request has finished. Returns the recorder, the
    decoders' and the burst's ids, per burst request the steps from its arrival to its
    first token, and per request the attention scores (per head and layer) its prompt's
    chunks computed."""
    engine = LLMEngine(
        model,
        tokenizer,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=budget or UNLIMITED,
        enable_chunked_prefill=budget is not None,
        long_prefill_token_threshold=threshold,
        scheduler="continuous",
        kv_cache="dense",
    )
    prompt_scores = count_prompt_scores(engine)
    rec = Recorder(engine)
    dec_ids = [rec.add(p, greedy(decoder_tokens)) for p in decoders]
    burst_ids: list[str] = []
    steps = arrival_step = 0
    prefill_steps: dict[str, int] = {}
    while engine.has_unfinished_requests():
        rec.step()
        steps += 1
        for r in burst_ids:
            if r not in prefill_steps and rec.token_times[r]:
                prefill_steps[r] = steps - arrival_step
        if not burst_ids and all(len(rec.token_times[r]) >= WARM_TOKENS for r in dec_ids):
            burst_ids = [rec.add(p, greedy(n)) for p, n in burst]
            arrival_step = steps
    if not burst_ids:
        raise RuntimeError("the decoders finished before the burst arrived")
    return rec, dec_ids, burst_ids, prefill_steps, prompt_scores


def count_prompt_scores(engine: LLMEngine) -> dict[str, int]:
    """Count, per request, the scores its prompt's chunks compute in the dense path: rows
    × every key up to the chunk's end (the product is computed whole, then masked). Reads
    the chunks each step hands the model runner."""
    scores: dict[str, int] = {}
    execute = engine.core.runner.execute

    def counting_execute(chunks, verify):
        for c in chunks:
            prompt_rows = min(c.end, len(c.request.prompt_token_ids)) - c.start
            if prompt_rows > 0:
                rid = c.request.request_id
                scores[rid] = scores.get(rid, 0) + prompt_rows * c.end
        return execute(chunks, verify)

    engine.core.runner.execute = counting_execute
    return scores


def gaps_between(rec: Recorder, rids: list[str], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive tokens of ``rids`` that end in ``(lo, hi]``."""
    return [b - a for r in rids
            for a, b in zip(rec.token_times[r], rec.token_times[r][1:], strict=False)
            if lo < b <= hi]


# ---------------------------------------------------------------- 1. the budget sweep


def run_budget(model, tokenizer, budget, decoders, decoder_tokens, long_prompt) -> dict[str, Any]:
    rec, dec_ids, (long_id,), prefill_steps, prompt_scores = run_engine(
        model, tokenizer, budget, None, decoders, decoder_tokens, [(long_prompt, LONG_OUTPUT)])
    t_long, t_end = rec.arrival[long_id], rec.finish[long_id]
    if any(rec.finish[r] < t_end for r in dec_ids):
        raise RuntimeError("a decoder finished before the long request; raise decoder_tokens")
    first = rec.token_times[long_id][0]
    gaps = gaps_between(rec, [*dec_ids, long_id], t_long, t_end)
    ttft = rec.ttft()
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "long_ttft_s": first - t_long,
        "long_prefill_steps": prefill_steps[long_id],
        "long_scores_vs_one_step": prompt_scores[long_id] / len(long_prompt) ** 2,
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "max_decode_gap_s": max(gaps),
        "output_tokens": rec.num_tokens(),
        "tok_per_s": rec.num_tokens() / rec.wall,
        "steps": len(rec.step_slots),
        "wall_s": rec.wall,
    }


# ---------------------------------------------------------------- 2. fairness


def run_fair(model, tokenizer, budget, threshold, decoders, decoder_tokens,
             burst) -> dict[str, Any]:
    rec, dec_ids, burst_ids, _, _ = run_engine(
        model, tokenizer, budget, fair_threshold(budget) if threshold else None, decoders,
        decoder_tokens, [(p, FAIR_OUTPUT) for p, _ in burst])
    longs = [r for r, (_, kind) in zip(burst_ids, burst, strict=True) if kind == "long"]
    shorts = [r for r, (_, kind) in zip(burst_ids, burst, strict=True) if kind == "short"]
    arrival = rec.arrival[burst_ids[0]]
    gaps = gaps_between(rec, dec_ids, arrival, float("inf"))
    short_ttft, long_ttft = rec.ttft(shorts), rec.ttft(longs)
    return {
        "short_ttft_p50_s": percentile(short_ttft, 50),
        "short_ttft_max_s": max(short_ttft),
        "long_ttft_p50_s": percentile(long_ttft, 50),
        "long_ttft_max_s": max(long_ttft),
        "max_decode_gap_s": max(gaps),
        "decode_gaps": len(gaps),
        "output_tokens": rec.num_tokens(),
        "tok_per_s": rec.num_tokens() / rec.wall,
        "steps": len(rec.step_slots),
        "wall_s": rec.wall,
    }


# ---------------------------------------------------------------- figure and main


def plot(summary: dict[str, dict], fair: dict[str, dict], long_tokens: int,
         fair_long_tokens: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axf) = plt.subplots(1, 2, figsize=(14, 4.8))
    x_unlimited = 2 ** int(np.ceil(np.log2(max(b for b in BUDGETS if b) * 4)))
    xs = [b or x_unlimited for b in BUDGETS]
    rows = [summary[label(b)] for b in BUDGETS]
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
    ax.set_title(f"Budget: a {long_tokens}-token prompt arrives while {NUM_DECODERS} "
                 "requests decode", fontsize=11)

    x = np.arange(len(FAIR_BUDGETS))
    for off, on, color in ((-0.2, False, "tab:gray"), (0.2, True, "tab:green")):
        vals = [fair[fair_label(b, on)]["short_ttft_p50_s"] for b in FAIR_BUDGETS]
        axf.bar(x + off, vals, 0.4, color=color,
                label=f"short TTFT p50, threshold {'on' if on else 'off'}")
        vals = [fair[fair_label(b, on)]["long_ttft_p50_s"] for b in FAIR_BUDGETS]
        axf.plot(x + off, vals, "k_", markersize=20)
    axf.set_xticks(x, [str(b) for b in FAIR_BUDGETS])
    axf.set_xlabel("max_num_batched_tokens")
    axf.set_ylabel("TTFT (s); dashes: long prompts' TTFT p50")
    axf.set_title(f"Fairness: {FAIR_NUM_LONG} x {fair_long_tokens}-token prompts and "
                  f"{FAIR_NUM_LONG * FAIR_SHORTS_PER_LONG} short ones at once", fontsize=11)
    axf.legend(fontsize=9)
    fig.tight_layout()
    return fig


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--long-tokens", type=int, default=None,
                    help="the sweep's long prompt (default 1024; quick: 256)")
    ap.add_argument("--fair-long-tokens", type=int, default=None,
                    help="the fairness burst's long prompts (default 512; quick: 128)")
    args = ap.parse_args()
    long_tokens = args.long_tokens or (256 if args.quick else 1024)
    fair_long_tokens = args.fair_long_tokens or (128 if args.quick else 512)
    if long_tokens >= UNLIMITED:
        ap.error(f"--long-tokens must be below the unlimited budget ({UNLIMITED})")
    t_start = time.perf_counter()

    model, tokenizer, model_name = load_model(args.quick)
    rng = random.Random(0)
    decoders = decoder_prompts(rng, NUM_DECODERS)
    long_prompt = random_prompt(rng, long_tokens)
    # Enough tokens to be still decoding when the long request finishes at the smallest
    # budget B (which gives it B - 8 tokens a step), plus the head start of the decoders
    # admitted first (their prompts are prefilled B tokens a step) and a margin.
    smallest = min(b for b in BUDGETS if b)
    head_start = -(-sum(map(len, decoders)) // smallest)
    decoder_tokens = (WARM_TOKENS + -(-long_tokens // (smallest - NUM_DECODERS)) + LONG_OUTPUT
                      + head_start + 8)
    fair_decoders = decoder_prompts(rng, FAIR_DECODERS)
    burst: list[tuple[list[int], str]] = []
    for _ in range(FAIR_NUM_LONG):
        burst.append((random_prompt(rng, fair_long_tokens), "long"))
        burst += [(random_prompt(rng, rng.randint(*FAIR_SHORT)), "short")
                  for _ in range(FAIR_SHORTS_PER_LONG)]
    burst_tokens = sum(len(p) for p, _ in burst)
    fair_decoder_tokens = (WARM_TOKENS + -(-burst_tokens // (min(FAIR_BUDGETS) - FAIR_DECODERS))
                           + FAIR_OUTPUT + 32)

    # Warmup: chunked and one-shot prefill paths, with and without a threshold.
    for budget, threshold in ((64, None), (None, None), (64, 16)):
        run_engine(model, tokenizer, budget, threshold, decoders[:4], 8,
                   [(long_prompt[:128], 2)])

    configs: list[tuple[str, Any]] = [("sweep", b) for b in BUDGETS] + [
        ("fair", (b, on)) for b in FAIR_BUDGETS for on in (False, True)]
    sweep_rounds: list[dict[str, dict]] = []
    fair_rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        sweep, fair = {}, {}
        for kind, cfg in configs if r % 2 == 0 else configs[::-1]:
            if kind == "sweep":
                m = run_budget(model, tokenizer, cfg, decoders, decoder_tokens, long_prompt)
                sweep[label(cfg)] = m
                print(f"round {r + 1}/{args.rounds} budget {label(cfg):>8}: {m['steps']} steps, "
                      f"{m['wall_s']:.1f} s, long TTFT {m['long_ttft_s']:.2f} s, "
                      f"max gap {m['max_decode_gap_s']:.2f} s", flush=True)
            else:
                m = run_fair(model, tokenizer, *cfg, fair_decoders, fair_decoder_tokens, burst)
                fair[fair_label(*cfg)] = m
                print(f"round {r + 1}/{args.rounds} fairness {fair_label(*cfg)}: "
                      f"short TTFT p50 {m['short_ttft_p50_s']:.2f} s, long TTFT p50 "
                      f"{m['long_ttft_p50_s']:.2f} s, max gap {m['max_decode_gap_s']:.2f} s",
                      flush=True)
        sweep_rounds.append(sweep)
        fair_rounds.append(fair)

    def summarize(rounds: list[dict[str, dict]]) -> tuple[dict, dict]:
        names = list(rounds[0])
        keys = list(rounds[0][names[0]])
        spreads = {n: {k: spread([rnd[n][k] for rnd in rounds]) for k in keys} for n in names}
        return {n: {k: v["median"] for k, v in s.items()} for n, s in spreads.items()}, spreads

    summary, sweep_spread = summarize(sweep_rounds)
    fair_summary, fair_spread = summarize(fair_rounds)
    tokens = {m["output_tokens"] for rnd in sweep_rounds for m in rnd.values()}
    fair_tokens = {m["output_tokens"] for rnd in fair_rounds for m in rnd.values()}
    assert len(tokens) == 1 and len(fair_tokens) == 1, "a table's runs differ in workload"

    def vs_unlimited(budget: int | None, key: str) -> float:
        return statistics.median(rnd[label(budget)][key] / rnd[label(None)][key]
                                 for rnd in sweep_rounds)

    rows = []
    for b in BUDGETS:
        s = summary[label(b)]
        rows.append([
            label(b), s["ttft_p50_s"], s["ttft_p99_s"], s["long_ttft_s"],
            s["long_prefill_steps"], s["long_scores_vs_one_step"], s["itl_p50_s"],
            s["itl_p99_s"], s["max_decode_gap_s"], s["tok_per_s"],
            vs_unlimited(b, "long_ttft_s"), vs_unlimited(b, "max_decode_gap_s"),
        ])
    fair_rows = []
    for b in FAIR_BUDGETS:
        for on in (False, True):
            s = fair_summary[fair_label(b, on)]
            ratio = statistics.median(
                rnd[fair_label(b, True)]["short_ttft_p50_s"]
                / rnd[fair_label(b, False)]["short_ttft_p50_s"] for rnd in fair_rounds)
            fair_rows.append([
                b, fair_threshold(b) if on else "off", s["short_ttft_p50_s"],
                s["short_ttft_max_s"], s["long_ttft_p50_s"], s["long_ttft_max_s"],
                s["max_decode_gap_s"], s["tok_per_s"], s["steps"], ratio if on else None,
            ])
    tables = [
        Table(
            f"1. Prefill budget sweep: a {long_tokens}-token prompt arrives while "
            f"{NUM_DECODERS} requests decode, {model_name}",
            ["budget", "TTFT p50 (s)", "TTFT p99 (s)", "long TTFT (s)", "long prefill steps",
             "long scores vs one step", "ITL p50 (s)", "ITL p99 (s)", "max decode gap (s)",
             "output tok/s", "long TTFT vs unlimited", "max gap vs unlimited"],
            rows,
            ["", ".2f", ".2f", ".2f", ".0f", ".2f", ".3f", ".3f", ".2f", ".1f", ".2f", ".2f"],
            note=(
                f"max_num_seqs={MAX_NUM_SEQS}, dense KV, continuous scheduler; decoders' "
                f"prompts 16-48 tokens, {decoder_tokens} tokens each; the long request "
                f"arrives once every decoder has {WARM_TOKENS} tokens and generates "
                f"{LONG_OUTPUT}. Every row serves the same {tokens.pop()} output tokens, so "
                "output tok/s compares rows of this table only. TTFT over all "
                f"{NUM_DECODERS + 1} requests; ITL and max gap over token gaps ending between "
                "the long request's arrival and its last token. Medians of "
                f"{args.rounds} round(s); the ratio columns are medians of per-round ratios "
                "to the unlimited budget."
            ),
        ),
        Table(
            f"2. Fairness: {FAIR_NUM_LONG} prompts of {fair_long_tokens} tokens and "
            f"{FAIR_NUM_LONG * FAIR_SHORTS_PER_LONG} of {FAIR_SHORT[0]}-{FAIR_SHORT[1]} "
            f"arrive at once (long, short, short, x{FAIR_NUM_LONG}) while {FAIR_DECODERS} "
            f"requests decode, {model_name}",
            ["budget", "long_prefill_token_threshold", "short TTFT p50 (s)",
             "short TTFT max (s)", "long TTFT p50 (s)", "long TTFT max (s)",
             "max decode gap (s)", "output tok/s", "steps", "short TTFT p50, on / off"],
            fair_rows,
            ["", "", ".3f", ".3f", ".3f", ".3f", ".3f", ".1f", ".0f", ".2f"],
            note=(
                f"Chunked prefill on, dense KV, max_num_seqs={MAX_NUM_SEQS}; each burst "
                f"request generates {FAIR_OUTPUT} tokens, each decoder {fair_decoder_tokens}. "
                "Threshold on = budget // 4 tokens per prompt per step. Max decode gap: the "
                "longest gap between consecutive tokens of the decoders after the burst "
                f"arrives. Every row serves the same {fair_tokens.pop()} output tokens, so "
                "output tok/s compares rows of this table only (not with table 1). Medians "
                f"of {args.rounds} round(s); the last column is the median of per-round "
                "ratios at the same budget."
            ),
        ),
    ]
    data = {
        "model": model_name,
        "quick": args.quick,
        "config": {"max_num_seqs": MAX_NUM_SEQS, "kv_cache": "dense",
                   "scheduler": "continuous", "unlimited_budget": UNLIMITED},
        "workload": {"decoder_prompt_lens": [len(p) for p in decoders],
                     "decoder_tokens": decoder_tokens,
                     "long_prompt_len": long_tokens, "long_output_tokens": LONG_OUTPUT,
                     "warm_tokens": WARM_TOKENS},
        "fair_workload": {"decoder_prompt_lens": [len(p) for p in fair_decoders],
                          "decoder_tokens": fair_decoder_tokens,
                          "burst": [[len(p), kind] for p, kind in burst],
                          "output_tokens": FAIR_OUTPUT,
                          "thresholds": {b: fair_threshold(b) for b in FAIR_BUDGETS}},
        "budgets": [b or UNLIMITED for b in BUDGETS],
        "rounds": sweep_rounds,
        "summary": summary,
        "spread": sweep_spread,
        "fair_rounds": fair_rounds,
        "fair_summary": fair_summary,
        "fair_spread": fair_spread,
        "bench_wall_s": None,
    }
    fig = plot(summary, fair_summary, long_tokens, fair_long_tokens)
    data["bench_wall_s"] = time.perf_counter() - t_start
    save_results("bench_week3_day2" + ("_quick" if args.quick else ""), data, tables, fig,
                 rounds=args.rounds)
    print(f"bench wall time {data['bench_wall_s']:.0f} s")


if __name__ == "__main__":
    main()
