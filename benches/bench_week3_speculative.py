"""Speculative decoding: acceptance and output speed against k and batch size, side by side
with speculation off, on a repetitive and a non-repetitive workload.

Model: the default (SmolLM2-135M-Instruct, float32 on the CPU); greedy, ``max_tokens``
fixed with ``ignore_eos``, so every configuration generates the same tokens (checked).

Workloads (chat-templated prompts):

- **repetitive**: the answer quotes the prompt — "repeat this paragraph", "rewrite this
  code renaming one variable" — text prompt lookup can predict;
- **non-repetitive**: open questions whose answers do not copy the prompt.

Measurements, each configuration once per round, rounds interleaved, median and spread:

1. **Batch 1**, per workload: output tok/s (generated tokens / wall time of the request,
   prefill included) with speculation off, prompt lookup (``ngram``) at k = 2, 4 and 8, and
   a draft model at k = 4 (the target's first 8 of its 30 layers, with its own norm and
   vocabulary projection: a draft with the same tokenizer that needs no second download);
   the drafts kept per verification step (mean and distribution).
2. **Batch size** 1, 2, 4, 8, 16 (the repetitive prompts, all arriving at once, taken in
   turn; at batch 1 each prompt alone and the mean, as in 1): output tok/s with speculation
   off and with prompt lookup at k = 4 on at every batch size (``speculative_max_batch``
   above the batch); the ratio per round, its median and range. The default policy drafts
   while at most ``speculative_max_batch`` requests run: at each batch it is one of the two
   configurations measured, and the table names which. Where the ratio's range straddles 1
   the two are not told apart by this run; ``speculative_max_batch`` is chosen from this
   table.
3. **Trees against chains** of as many drafts (4 and 8), with prompt lookup and with the
   draft model, per workload, at batch 1 (each prompt alone) and 8: output tok/s, the
   acceptance length (tokens emitted
   per verifying forward: drafts kept plus the token after them) and its distribution, the
   drafts actually verified per step, and the acceptance length predicted from the measured
   rate at which a child of each rank is kept (``predicted_length``; for a chain, one rate
   ``α`` and ``(1 - α^(k+1)) / (1 - α)``).

    python benches/bench_week3_speculative.py           # about 15 minutes on 2 cores
    python benches/bench_week3_speculative.py --quick   # tiny random model, writes *_quick.*
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tiny_llm import EngineConfig, LLMEngine, Model, ModelConfig

import mlx.core as mx
from common import Table, bench_parser, greedy, load_model, save_results, spread

PARAGRAPH = (
    "The paged KV cache stores keys and values in fixed-size pages taken from one shared "
    "pool. Each sequence owns a block table that maps its logical positions to physical "
    "pages, so memory is allocated in small units as sequences grow, and requests with a "
    "common prefix share pages instead of copying them."
)
CODE = (
    "def total_price(items, tax):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax)\n"
)
WORKLOADS = {
    "repetitive": [
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Rewrite this Python function, renaming the variable subtotal to amount. "
        f"Output only the code.\n\n{CODE}",
    ],
    "non-repetitive": [
        "Give three tips for staying focused while studying.",
        "Why is the sky blue? Explain in a few sentences.",
    ],
}
BATCHES = (1, 2, 4, 8, 16)
# Trees and chains of as many drafts, as speculative_token_tree takes them.
SHAPES = {
    "chain 4": [(0,) * depth for depth in range(1, 5)],
    "tree 4: 2 wide": [(0,), (1,), (0, 0), (0, 0, 0)],
    "chain 8": [(0,) * depth for depth in range(1, 9)],
    "tree 8: 2 chains of 4": [(r, *(0,) * d) for d in range(4) for r in range(2)],
    "tree 8: 4 chains of 2": [(r, *(0,) * d) for d in range(2) for r in range(4)],
}
TREE_BATCHES = (1, 8)


def predicted_length(paths: list[tuple[int, ...]], rates: list[float]) -> float:
    """Tokens per verifying forward a tree of ``paths`` would emit if a child of rank r,
    once tried, were kept with probability ``rates[r]`` (a rank never tried: 0),
    independently of everything else: 1 (the token after the kept path) plus each node's
    chance of being kept — its parent kept, its elder siblings rejected, itself kept. For a
    chain of k, ``(1 - α^(k+1)) / (1 - α)`` with ``α = rates[0]``."""
    kept: dict[tuple[int, ...], float] = {(): 1.0}
    for path in sorted(paths, key=len):
        chance = kept[path[:-1]] * (rates[path[-1]] if path[-1] < len(rates) else 0.0)
        for elder in range(path[-1]):
            chance *= 1 - (rates[elder] if elder < len(rates) else 0.0)
        kept[path] = chance
    return 1 + sum(chance for path, chance in kept.items() if path)


def early_exit_draft(model: Model, num_layers: int) -> Model:
    """The target's first ``num_layers`` layers with its embeddings, final norm and
    vocabulary projection: the same arrays, no copy."""
    cfg = ModelConfig(**{**model.config.__dict__, "num_hidden_layers": num_layers})
    draft = Model(cfg)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = model.model.layers[:num_layers]
    draft.model.norm = model.model.norm
    if not cfg.tie_word_embeddings:
        draft.lm_head = model.lm_head
    return draft


def serve(model, tokenizer, prompts: list, max_tokens: int, **options: Any) -> dict[str, Any]:
    engine = LLMEngine(model, tokenizer, num_pages=1024, max_model_len=1024,
                       max_num_seqs=16, **options)
    start = time.perf_counter()
    outs = engine.generate(prompts, greedy(max_tokens), use_tqdm=False)
    wall = time.perf_counter() - start
    stats = engine.stats()
    return {"tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "tokens": [o.outputs[0].token_ids for o in outs], "stats": stats}


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    model, tokenizer, model_name = load_model(args.quick, num_hidden_layers=4)
    max_tokens = 16 if args.quick else 64
    draft_layers = 1 if args.quick else 8
    draft = (early_exit_draft(model, draft_layers), tokenizer)
    batch1 = {
        "off": {},
        "ngram k=2": dict(speculative="ngram", num_speculative_tokens=2),
        "ngram k=4": dict(speculative="ngram", num_speculative_tokens=4),
        "ngram k=8": dict(speculative="ngram", num_speculative_tokens=8),
        "draft k=4": dict(speculative="draft", num_speculative_tokens=4, draft_model=draft),
    }
    default_max = EngineConfig().speculative_max_batch
    by_batch = {
        "off": {},
        "ngram": dict(speculative="ngram", num_speculative_tokens=4,
                      speculative_max_batch=max(BATCHES)),
    }
    proposers = {"ngram": dict(speculative="ngram"),
                 "draft": dict(speculative="draft", draft_model=draft)}
    trees = {"off": {}, **{f"{proposer}, {name}": dict(
        **options, speculative_token_tree=paths, speculative_max_batch=max(TREE_BATCHES))
        for proposer, options in proposers.items() for name, paths in SHAPES.items()}}
    chats = {w: [[{"role": "user", "content": p}] for p in ps] for w, ps in WORKLOADS.items()}
    serve(model, tokenizer, chats["repetitive"][:1], 4)  # warm up
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for workload, prompts in chats.items():
            names = list(batch1) if r % 2 == 0 else list(batch1)[::-1]
            for name in names:
                for i, prompt in enumerate(prompts):
                    runs.setdefault(f"b1|{workload}|{name}|{i}", []).append(
                        serve(model, tokenizer, [prompt], max_tokens, **batch1[name]))
        repetitive = chats["repetitive"]
        for b in BATCHES:
            batches = [[p] for p in repetitive] if b == 1 else \
                [[repetitive[i % len(repetitive)] for i in range(b)]]
            for name in (list(by_batch) if r % 2 == 0 else list(by_batch)[::-1]):
                for i, batch in enumerate(batches):
                    runs.setdefault(f"batch|{b}|{name}|{i}", []).append(
                        serve(model, tokenizer, batch, max_tokens, **by_batch[name]))
        for workload, prompts in chats.items():
            for b in TREE_BATCHES:
                batches = [[p] for p in prompts] if b == 1 else \
                    [[prompts[i % len(prompts)] for i in range(b)]]
                for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    for i, batch in enumerate(batches):
                        runs.setdefault(f"tree|{workload}|{b}|{name}|{i}", []).append(
                            serve(model, tokenizer, batch, max_tokens, **trees[name]))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    def same(key: str, base: str) -> bool:
        return all(x["tokens"] == y["tokens"] for x, y in zip(runs[key], runs[base], strict=True))

    rows1, data1 = [], {}
    for workload, prompts in chats.items():
        for name in batch1:
            keys = [f"b1|{workload}|{name}|{i}" for i in range(len(prompts))]
            per_round = [statistics.mean(runs[k][r]["tok_per_s"] for k in keys)
                         for r in range(args.rounds)]
            base = [statistics.mean(runs[f"b1|{workload}|off|{i}"][r]["tok_per_s"]
                                    for i in range(len(prompts))) for r in range(args.rounds)]
            ratio = [a / b for a, b in zip(per_round, base, strict=True)]
            hist = [0] * 9
            kept = drafts = steps = 0
            for k in keys:
                st = runs[k][0]["stats"]
                for n, c in enumerate(st.get("acceptance_histogram", [])):
                    hist[n] += c
                kept += st.get("num_accepted_tokens", 0)
                drafts += st.get("num_draft_tokens", 0)
                steps += st.get("num_verify_steps", 0)
            identical = all(same(k, f"b1|{workload}|off|{i}") for i, k in enumerate(keys))
            data1[f"{workload}|{name}"] = {"tok_per_s": spread(per_round),
                                           "ratio": spread(ratio), "histogram": hist,
                                           "kept": kept, "drafts": drafts, "steps": steps}
            rows1.append([workload, name, statistics.median(per_round), min(per_round),
                          max(per_round), statistics.median(ratio),
                          kept / steps if steps else None,
                          kept / drafts if drafts else None,
                          histogram_text(hist) if steps else "–",
                          "yes" if identical else "NO"])
    rows2, data2 = [], {}
    for b in BATCHES:
        n = len(chats["repetitive"]) if b == 1 else 1
        base = mean_tok_per_s(runs, f"batch|{b}|off|", args.rounds)
        tps = mean_tok_per_s(runs, f"batch|{b}|ngram|", args.rounds)
        ratio = [a / c for a, c in zip(tps, base, strict=True)]
        data2[f"{b}|ngram"] = {"tok_per_s": spread(tps), "ratio": spread(ratio)}
        identical = all(same(f"batch|{b}|ngram|{i}", f"batch|{b}|off|{i}") for i in range(n))
        rows2.append([b, statistics.median(base), statistics.median(tps),
                      statistics.median(ratio), min(ratio), max(ratio),
                      "ngram" if b <= default_max else "off", "yes" if identical else "NO"])
    rows3, data3 = tree_rows(runs, chats, trees, args.rounds)
    tables = [
        Table("1. Batch 1: output tok/s (prefill included) and drafts kept",
              ["workload", "speculation", "tok/s", "min", "max", "× off", "kept / step",
               "kept / drafted", "steps keeping 0, 1, 2, ... drafts", "same tokens"],
              rows1, ["", "", ".1f", ".1f", ".1f", ".2f", ".2f", ".2f", "", ""],
              f"{model_name}; {max_tokens} tokens per request, greedy; tok/s is the mean over "
              "the workload's prompts, median over rounds (min and max across rounds); "
              f"draft: the target's first {draft_layers} of its "
              f"{model.config.num_hidden_layers} layers."),
        Table("2. Output tok/s against batch size (repetitive prompts, all at once)",
              ["batch", "off", "ngram", "× off", "× off, min", "× off, max",
               "default policy", "same tokens"],
              rows2, ["", ".1f", ".1f", ".2f", ".2f", ".2f", "", ""],
              "Prompt lookup at k = 4, on at every batch size; × off: the ratio within each "
              "round, its median, min and max over rounds; batch 1: each prompt alone, the "
              "mean (as in table 1). Default policy: what the engine runs at that batch "
              f"(prompt lookup while at most speculative_max_batch = {default_max} requests "
              "run), one of the two columns measured."),
        Table("3. Trees against chains of as many drafts (prompt lookup and the draft "
              "model): tokens per verifying forward, measured and predicted",
              ["workload", "batch", "proposer, drafts", "tok/s", "× off", "tokens / forward",
               "predicted, shape", "predicted, verified", "verified / step",
               "steps keeping 0, 1, 2, ... drafts", "same tokens"],
              rows3, ["", "", "", ".1f", ".2f", ".2f", ".2f", ".2f", ".2f", "", ""],
              "tokens / forward: the acceptance length, drafts kept plus the token after them, "
              "per verifying step; predicted: from the measured rate at which a child of "
              "each rank is kept (predicted_length), for the configured shape and for the "
              "shapes the steps verified (prompt lookup leaves out the nodes it has no "
              "continuation for: verified / step); batch 1: each prompt alone, the mean; "
              "tok/s and × off: median over rounds."),
    ]
    figure = plot(rows2, default_max)
    save_results("bench_week3_speculative" + ("_quick" if args.quick else ""),
                 {"batch1": data1, "by_batch": data2, "trees": data3, "model": model_name,
                  "max_tokens": max_tokens}, tables, figure, rounds=args.rounds)


def tree_rows(runs: dict[str, list[dict]], chats: dict[str, list], trees: dict[str, dict],
              rounds: int) -> tuple[list[list], dict[str, Any]]:
    """Table 3's rows: per workload, batch and shape, speed against off, and the measured and
    predicted acceptance lengths (counters from each run's first round)."""
    rows, data = [], {}
    for workload in chats:
        for b in TREE_BATCHES:
            off = mean_tok_per_s(runs, f"tree|{workload}|{b}|off|", rounds)
            for name in list(trees)[1:]:
                prefix = f"tree|{workload}|{b}|{name}|"
                tps = mean_tok_per_s(runs, prefix, rounds)
                ratio = statistics.median(a / o for a, o in zip(tps, off, strict=True))
                keys = [k for k in runs if k.startswith(prefix)]
                acceptance = tree_acceptance([runs[k][0]["stats"] for k in keys])
                paths = trees[name]["speculative_token_tree"]
                acceptance["predicted"] = predicted_length(paths, acceptance["rank_rates"])
                identical = all(
                    x["tokens"] == y["tokens"]
                    for k in keys for x, y in zip(runs[k], runs[k.replace(f"|{name}|", "|off|")],
                                                  strict=True))
                data[f"{workload}|{b}|{name}"] = {"tok_per_s": spread(tps), "ratio": ratio,
                                                  **acceptance}
                rows.append([workload, b, name, statistics.median(tps), ratio,
                             acceptance["acceptance_length"], acceptance["predicted"],
                             acceptance["predicted_verified"], acceptance["verified_per_step"],
                             histogram_text(acceptance["histogram"])
                             if acceptance["steps"] else "–",
                             "yes" if identical else "NO"])
    return rows, data


def mean_tok_per_s(runs: dict[str, list[dict]], prefix: str, rounds: int) -> list[float]:
    """Per round, the mean output tok/s of the runs under ``prefix``."""
    keys = [k for k in runs if k.startswith(prefix)]
    return [statistics.mean(runs[k][r]["tok_per_s"] for k in keys) for r in range(rounds)]


def tree_acceptance(stats: list[dict]) -> dict[str, Any]:
    """Acceptance measured over the runs' counters: its length per verifying step, its
    distribution, each child rank's rate, and the lengths those rates predict for the
    configured shape and for the shapes the steps actually verified."""
    tries, accepts, hist = [0] * 8, [0] * 8, [0] * 9
    shapes: dict[tuple, int] = {}
    total = dict.fromkeys(("num_accepted_tokens", "num_draft_tokens", "num_verify_steps"), 0)
    for s in stats:
        for counter, into in (("rank_tries", tries), ("rank_accepts", accepts),
                              ("acceptance_histogram", hist)):
            for i, n in enumerate(s.get(counter, [])):
                into[i] += n
        for paths, n in s.get("verified_shapes", []):
            key = tuple(map(tuple, paths))
            shapes[key] = shapes.get(key, 0) + n
        for counter in total:
            total[counter] += s.get(counter, 0)
    steps = total["num_verify_steps"]
    rates = [a / t if t else 0.0 for a, t in zip(accepts, tries, strict=True)]
    return {"steps": steps, "histogram": hist, "rank_rates": rates, **total,
            "acceptance_length": (total["num_accepted_tokens"] + steps) / steps if steps else None,
            "verified_per_step": total["num_draft_tokens"] / steps if steps else None,
            "predicted_verified": sum(n * predicted_length(list(shape), rates)
                                      for shape, n in shapes.items()) / steps if steps else None}


def histogram_text(hist: list[int]) -> str:
    while len(hist) > 1 and hist[-1] == 0:
        hist = hist[:-1]
    return " ".join(str(c) for c in hist)


def plot(rows2: list[list], default_max: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    batches = [r[0] for r in rows2]
    ax.errorbar(batches, [r[3] for r in rows2],
                yerr=[[r[3] - r[4] for r in rows2], [r[5] - r[3] for r in rows2]],
                fmt="o-", capsize=3, label="prompt lookup, k = 4 (median, min-max of rounds)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axvline(default_max, color="gray", ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests running at once")
    ax.set_ylabel("output tok/s, × speculation off")
    ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    mx.random.seed(0)
    main()
