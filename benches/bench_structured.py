"""What a structured output costs a decode step: batches of 1, 8 and 32 requests, each
constrained by a JSON schema, next to the same batches unconstrained.

The default model (SmolLM2-135M, float32), the default engine. Every request of a batch
has its own chat prompt; greedy; the constrained ones follow a schema of three fields (a
name, an integer, a text of at least 200 characters, so that no request completes its JSON
within the run), the unconstrained ones decode the same number of tokens (``ignore_eos``):
both keep the whole batch decoding to the end. Reported per batch size: the median decode
step (steps after the first three, which hold the prefill), constrained and not, their ratio,
and the grammar's share measured alone: each constrained row's mask (llguidance's
``compute_bitmask``, unpacked to one flag per token) and the masking of its logits, timed
for the same states outside the step. A constrained row also leaves the device's batched
argmax for the host's sampler (a mask is applied on the host), which the step's ratio
includes. Rounds interleave the two (``--rounds``, median of the per-round medians).

    python benches/bench_structured.py            # about a minute on 2 cores
    python benches/bench_structured.py --quick    # a tiny random model, one round
"""

from __future__ import annotations

import statistics
import time

from common import Table, bench_parser, goals_table, load_model, save_results, spread

BATCHES = (1, 8, 32)
TOKENS = 40  # decode steps per run
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "bio": {"type": "string", "minLength": 200}}, "required": ["name", "age", "bio"],
    "additionalProperties": False}
GOAL = 1.10  # constrained / unconstrained step time at batch 32


def run(engine, batch: int, constrained: bool) -> tuple[float, float]:
    """(median decode step, median seconds of the constrained rows' masks per step)."""
    from tiny_llm import SamplingParams
    from tiny_llm.structured import StructuredOutput
    from tiny_llm.structured import constrained as mask_row

    import numpy as np

    spec = StructuredOutput(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, structured=spec,
                            ignore_eos=not constrained)
    requests = [engine.requests[engine.add_request(
        [{"role": "user", "content": f"Describe person {i} as JSON."}], params)]
        for i in range(batch)]
    steps, masks = [], []
    row = np.zeros(engine.model.config.vocab_size, dtype=np.float32)
    while engine.has_unfinished_requests():
        full = all(not r.is_finished for r in requests)
        start = time.perf_counter()
        engine.step()
        if full:  # a step of the whole batch (the schema keeps every request going)
            steps.append(time.perf_counter() - start)
        live = [r for r in requests if not r.is_finished and r.sampler.constraint]
        start = time.perf_counter()
        for r in live:  # the same states the next step masks from
            mask_row(row, r.sampler.constraint)
        masks.append(time.perf_counter() - start)
    return statistics.median(steps[3:]), statistics.median(masks[3:]) if constrained else 0.0


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    from tiny_llm import LLMEngine

    model, tokenizer, label = load_model(args.quick)
    engine = LLMEngine(model, tokenizer, num_pages=1024, max_num_seqs=max(BATCHES))
    run(engine, 4, True)  # warm up: the grammar compiled, the kernels' threads started
    rounds = 1 if args.quick and args.rounds == 3 else args.rounds
    results: dict[str, list[float]] = {}
    for r in range(rounds):
        for batch in BATCHES:
            order = (False, True) if r % 2 == 0 else (True, False)
            for constrained in order:
                step, mask = run(engine, batch, constrained)
                results.setdefault(f"{batch}/{constrained}", []).append(step)
                if constrained:
                    results.setdefault(f"{batch}/mask", []).append(mask)
    rows, ratio_at_32 = [], None
    for batch in BATCHES:
        free = statistics.median(results[f"{batch}/False"])
        bound = statistics.median(results[f"{batch}/True"])
        mask = statistics.median(results[f"{batch}/mask"])
        ratio = statistics.median(c / u for c, u in zip(results[f"{batch}/True"],
                                                         results[f"{batch}/False"], strict=True))
        ratio_at_32 = ratio if batch == 32 else ratio_at_32
        rows.append([batch, free * 1e3, bound * 1e3, ratio, (ratio - 1) * 100, mask * 1e3,
                     mask / bound * 100])
    table = Table(f"A decode step with every request under a JSON schema ({label}, greedy)",
                  ["batch", "unconstrained ms", "constrained ms", "constrained / unconstrained",
                   "overhead %", "masks ms", "masks % of the step"], rows,
                  formats=["", ".1f", ".1f", ".3f", ".1f", ".2f", ".1f"],
                  note="Median decode step; the ratio is the median of per-round ratios. "
                       "Masks: the constrained rows' masks and their application, timed "
                       "alone for the states the steps masked from.")
    goals = goals_table("The goal", [(
        f"structured decoding costs under {(GOAL - 1) * 100:.0f}% at batch 32",
        f"{(ratio_at_32 - 1) * 100:.1f}%", ratio_at_32 < GOAL)])
    save_results("bench_structured" + ("_quick" if args.quick else ""),
                 {"steps": {k: spread(v) for k, v in results.items()}, "schema": SCHEMA,
                  "tokens": TOKENS}, [table, goals], rounds=rounds)


if __name__ == "__main__":
    main()
