"""Which of the engine's files and functions one greedy request passes through.

Builds a tiny random Llama-shaped model with the default model's tokenizer (no
download), serves one warm-up request, then traces a second one through ``LLMEngine``'s
``generate`` with ``sys.setprofile`` and counts the Python calls made in ``src/tiny_llm``:
files, distinct functions, calls (comprehensions and generator expressions are not counted:
a reader does not follow them as functions), and *returns*: calls that enter a file the
trace had entered and left before (control went to another file since), of which *back up*
the ones whose file is still on the stack (a callee calling back into its caller's file, as
template-method hooks do). A measure of how much of the core a reader follows for one
request, and of how often the path turns back.

    python tools/trace_request.py            # a table per file
    python tools/trace_request.py --json     # the counts as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

COMPREHENSIONS = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}
SRC = Path(__file__).resolve().parent.parent / "src" / "tiny_llm"
TINY = dict(model_type="llama", vocab_size=49152, hidden_size=64, num_hidden_layers=2,
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)


class Trace:
    """Calls per (file, function), and the returns into files, of one traced run."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.returns = 0
        self.back_up = 0
        self._entered: set[str] = set()
        self._stack: list[str] = []  # the file of each traced frame, innermost last

    def call(self, path: str, function: str) -> None:
        self.calls[(path, function)] += 1
        caller = self._stack[-1] if self._stack else None
        if path != caller and path in self._entered:
            self.returns += 1
            self.back_up += path in self._stack
        self._entered.add(path)
        self._stack.append(path)

    def leave(self) -> None:
        self._stack.pop()


def trace() -> Trace:
    """What one greedy request of 8 tokens passes through while it is served."""
    import tiny_llm  # noqa: F401 (before mlx.core: it interposes OpenBLAS)
    from tiny_llm import (
        LLMEngine,
        Model,
        ModelConfig,
        SamplingParams,
        Tokenizer,
        default_model_path,
    )

    import mlx.core as mx

    mx.random.seed(0)
    model = Model(ModelConfig.from_hf(TINY))  # random weights: the path, not the text
    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    engine = LLMEngine(model, Tokenizer.from_gguf_metadata(meta), max_model_len=256)
    prompt = {"prompt_token_ids": list(range(1, 20))}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate(prompt, params, use_tqdm=False)  # warm: caches and first-call paths
    traced = Trace()
    root = str(SRC)

    def profile(frame, event, arg):  # noqa: ANN001 (sys.setprofile's signature)
        code = frame.f_code
        if (event not in ("call", "return") or not code.co_filename.startswith(root)
                or code.co_name in COMPREHENSIONS):
            return
        if event == "return":
            traced.leave()
        else:
            traced.call(str(Path(code.co_filename).relative_to(SRC.parent)), code.co_qualname)

    sys.setprofile(profile)
    try:
        engine.generate(prompt, params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    return traced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args()
    traced = trace()
    calls = traced.calls
    files = Counter()
    functions = Counter()
    for (path, _), n in calls.items():
        files[path] += n
        functions[path] += 1
    summary = dict(files=len(files), functions=len(calls), calls=sum(calls.values()),
                   returns=traced.returns, back_up=traced.back_up,
                   per_file={p: dict(functions=functions[p], calls=files[p]) for p in files})
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for path in sorted(files):
        print(f"{path:45} {functions[path]:4} functions {files[path]:6} calls")
    print(f"{summary['files']} files, {summary['functions']} functions, "
          f"{summary['calls']} calls, {summary['returns']} returns "
          f"({summary['back_up']} back up the stack)")


if __name__ == "__main__":
    main()
