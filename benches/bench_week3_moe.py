"""Mixture of Experts: serving speed against a dense model of the same active size, the
gathered matmul against a per-expert loop, expert load per layer, and dispatch's share.

Models (random float32 weights, built here; the SmolLM2 tokenizer):

- **tiny**: Qwen3-MoE, hidden 64, 2 layers, 8 experts of width 32, top-2;
- **mid**: Qwen3-MoE, hidden 512, 8 layers, 32 experts of width 256, top-4 (132 M
  parameters with the tied embedding, 44 M of them used per token);
- each against the **dense twin**: the same model with one SwiGLU MLP of width
  ``top_k x expert width`` in place of the experts: the same active parameters (and flops)
  per token, but all of them read every step.

Measurements, rounds interleaved, median and spread:

1. Output tok/s serving 1 and 16 requests (64-token prompts, 32 greedy tokens each): the
   MoE with the default dispatch ("auto"), with the gathered matmul (``mx.gather_mm``) for
   every step, with one matmul per active expert for every step, and the dense twin.
2. The sparse block alone on T token rows (1 to 256): gathered matmul, per-expert loop, and
   the default's choice (where the crossover lies: ``LOOP_MIN_ROWS_PER_EXPERT``).
3. Where a step's time goes (mid model, 16 rows, one decode step): routing (router matmul,
   softmax, top-k), dispatch (sort and gather), the experts, combine, as a share of the
   whole forward.
4. Expert load per layer over a 16-request run, untimed (the plot): tokens routed to each expert.
   With random weights the router spreads tokens fairly evenly; a trained router does not.

    python benches/bench_week3_moe.py           # about 5 minutes on 2 cores
    python benches/bench_week3_moe.py --quick   # tiny model only, writes *_quick.*
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tiny_llm import LLMEngine
from tiny_llm.moe import LOOP_MIN_ROWS_PER_EXPERT, SparseMoeBlock, combine, dispatch, route
from tiny_llm.testing.models import make_tiny_model

import mlx.core as mx
import numpy as np
from common import Table, bench_parser, greedy, load_model, measure, save_results, spread

SHAPES = {
    "tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "mid": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                moe_intermediate_size=256),
}
PROMPT, MAX_TOKENS, BATCHES, ROWS = 64, 32, (1, 16), (1, 4, 8, 16, 32, 64, 256)


def models(shape: dict[str, Any]):
    """The MoE and its dense twin (same attention, embeddings and active width)."""
    moe = make_tiny_model("qwen3_moe", norm_topk_prob=True, **shape)
    width = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
    dense_shape = {k: v for k, v in shape.items() if not k.startswith(("num_experts", "moe_"))}
    dense = make_tiny_model("qwen3", intermediate_size=width, **dense_shape)
    return moe, dense


def sparse_blocks(model) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def serve(model, tokenizer, batch: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, PROMPT).tolist()}
               for _ in range(batch)]
    engine = LLMEngine(model, tokenizer, max_num_seqs=16, num_pages=512, max_model_len=512)
    start = time.perf_counter()
    outs = engine.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def set_mode(model, mode: str) -> None:
    for block in sparse_blocks(model):
        block.dispatch_mode = mode


def block_times(block: SparseMoeBlock, rows: int) -> dict[str, float]:
    x = mx.random.normal((rows, block.gate.weight.shape[1]))
    out = {}
    for mode in ("gather", "loop", "auto"):
        block.dispatch_mode = mode
        out[mode] = measure(lambda: block(x), repeats=7).median
    block.dispatch_mode = "auto"
    return out


def phases(model, rows: int) -> dict[str, float]:
    """Seconds per phase of every sparse block, and of the whole forward, on ``rows`` rows
    (each phase evaluated on its own, so the shares are of separately timed pieces)."""
    from tiny_llm import DenseKVCache

    blocks = sparse_blocks(model)
    x = mx.random.normal((rows, model.config.hidden_size))
    tokens = mx.arange(rows) + 100
    b = blocks[0]
    routing = route(b.gate(x), b.top_k, b.norm_topk_prob)
    grouped = dispatch(x, routing.experts)
    outputs = b.switch_mlp(grouped.rows, grouped.expert_ids)
    mx.eval(routing, grouped, outputs)
    n = len(blocks)
    return {
        "routing": n * measure(lambda: route(b.gate(x), b.top_k, b.norm_topk_prob)).median,
        "dispatch": n * measure(lambda: dispatch(x, routing.experts)).median,
        "experts": n * measure(lambda: b.switch_mlp(grouped.rows, grouped.expert_ids)).median,
        "combine": n * measure(lambda: combine(outputs, grouped.order, routing.weights)).median,
        "forward": measure(lambda: model(tokens, mx.arange(rows),
                                         DenseKVCache(model.config.num_hidden_layers))).median,
    }


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    _, tokenizer, _ = load_model(True)
    names = ["tiny"] if args.quick else ["tiny", "mid"]
    pairs = {name: models(SHAPES[name]) for name in names}
    variants = ["MoE, auto (default)", "MoE, gathered matmul", "MoE, per-expert loop",
                "dense twin"]
    modes = dict(zip(variants, ["auto", "gather", "loop", "auto"], strict=True))
    speed: dict[str, list[float]] = {}
    counts: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        for name, (moe, dense) in pairs.items():
            for batch in BATCHES:
                order = variants if r % 2 == 0 else variants[::-1]
                for variant in order:
                    model = dense if variant == "dense twin" else moe
                    set_mode(moe, modes[variant])
                    speed.setdefault(f"{name}|{batch}|{variant}", []).append(
                        serve(model, tokenizer, batch, seed=r))
                set_mode(moe, "auto")
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for name, (moe, _) in pairs.items():  # untimed: observing reads routing on the host
        counts[name] = record_load(moe)
        serve(moe, tokenizer, max(BATCHES), seed=0)
        for block in sparse_blocks(moe):
            block.observer = None

    rows1, data1 = [], {}
    for name in names:
        for batch in BATCHES:
            base = speed[f"{name}|{batch}|dense twin"]
            row = [name, batch]
            for variant in variants:
                tps = speed[f"{name}|{batch}|{variant}"]
                data1[f"{name}|{batch}|{variant}"] = spread(tps)
                row.append(statistics.median(tps))
            auto = speed[f"{name}|{batch}|{variants[0]}"]
            for other in (base, speed[f"{name}|{batch}|{variants[1]}"]):
                row.append(statistics.median([a / b for a, b in zip(auto, other, strict=True)]))
            rows1.append(row)

    big = names[-1]
    blocks = sparse_blocks(pairs[big][0])
    rows2, data2 = [], {}
    for rows in ROWS:
        t = block_times(blocks[0], rows)
        data2[rows] = t
        rows2.append([rows, rows * blocks[0].top_k / blocks[0].num_experts, t["gather"] * 1e3,
                      t["loop"] * 1e3, t["auto"] * 1e3, t["loop"] / t["gather"]])
    ph = phases(pairs[big][0], 16)
    rows3 = [[k, v * 1e3, v / ph["forward"]] for k, v in ph.items()]

    tables = [
        Table("1. Output tok/s: MoE against its dense twin (same active parameters)",
              ["model", "requests", *variants, "auto × dense", "auto × gathered"],
              rows1, ["", "", ".1f", ".1f", ".1f", ".1f", ".2f", ".2f"],
              f"{PROMPT}-token prompts, {MAX_TOKENS} greedy tokens each, paged KV and tiled "
              "attention (the engine's defaults); median over rounds."),
        Table(f"2. One sparse block ({big}) on T rows: milliseconds",
              ["rows", "rows per expert", "gathered matmul", "per-expert loop", "auto",
               "loop / gathered"],
              rows2, ["", ".2f", ".3f", ".3f", ".3f", ".2f"],
              "median of 7 calls after a warmup; auto loops from "
              f"{LOOP_MIN_ROWS_PER_EXPERT} rows per expert (on the CPU)."),
        Table(f"3. A 16-row forward of the {big} model: time per phase, all sparse layers",
              ["phase", "ms", "share of the forward"], rows3, ["", ".3f", ".1%"],
              "each phase timed on its own (so the shares need not add up to 100%)."),
    ]
    figure = plot(counts)
    save_results("bench_week3_moe" + ("_quick" if args.quick else ""),
                 {"tok_per_s": data1, "block_ms": data2, "phases": ph,
                  "expert_load": {k: v.tolist() for k, v in counts.items()},
                  "shapes": SHAPES}, tables, figure, rounds=args.rounds)


def record_load(model) -> np.ndarray:
    """Expert counts ``[layers, E]``, accumulated by observers until they are removed."""
    blocks = sparse_blocks(model)
    counts = np.zeros((len(blocks), blocks[0].gate.weight.shape[0]), dtype=np.int64)
    for i, block in enumerate(blocks):
        def observe(routing, i=i):
            counts[i] += np.bincount(np.array(routing.experts).reshape(-1),
                                     minlength=counts.shape[1])
        block.observer = observe
    return counts


def plot(counts: dict[str, np.ndarray]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 3.5), squeeze=False)
    for ax, (name, c) in zip(axes[0], counts.items(), strict=True):
        share = c / c.sum(axis=1, keepdims=True)
        im = ax.imshow(share, aspect="auto", cmap="viridis")
        ax.set_title(f"{name}: share of routed tokens")
        ax.set_xlabel("expert")
        ax.set_ylabel("sparse layer")
        ax.set_yticks(range(c.shape[0]))
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    mx.random.seed(0)
    main()
