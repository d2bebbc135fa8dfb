"""Which of the engine's files and functions one greedy request passes through.

Builds a tiny random Llama-shaped model with the default model's tokenizer (no
download), serves one warm-up request, then traces a second one through ``LLMEngine``'s
``generate`` with ``sys.setprofile`` and counts the Python calls made in ``src/tiny_llm``:
files, distinct functions, calls (comprehensions and generator expressions are not counted:
a reader does not follow them as functions). A measure of how much of the core a reader
follows for one request.

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


def trace() -> Counter[tuple[str, str]]:
    """Calls per (file, function) while one greedy request of 8 tokens is served."""
    import tiny_llm  # noqa: F401 (before mlx.core: it interposes OpenBLAS)
    from tiny_llm.engine import LLMEngine
    from tiny_llm.loader import default_model_path
    from tiny_llm.model import Model, ModelConfig
    from tiny_llm.sampling import SamplingParams
    from tiny_llm.tokenizer import Tokenizer

    import mlx.core as mx

    mx.random.seed(0)
    model = Model(ModelConfig.from_hf(TINY))  # random weights: the path, not the text
    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    engine = LLMEngine(model, Tokenizer.from_gguf_metadata(meta), max_model_len=256)
    prompt = {"prompt_token_ids": list(range(1, 20))}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate(prompt, params, use_tqdm=False)  # warm: caches and first-call paths
    calls: Counter[tuple[str, str]] = Counter()
    root = str(SRC)

    def profile(frame, event, arg):  # noqa: ANN001 (sys.setprofile's signature)
        code = frame.f_code
        if (event == "call" and code.co_filename.startswith(root)
                and code.co_name not in COMPREHENSIONS):
            path = Path(code.co_filename).relative_to(SRC.parent)
            calls[(str(path), code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        engine.generate(prompt, params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args()
    calls = trace()
    files = Counter()
    functions = Counter()
    for (path, _), n in calls.items():
        files[path] += n
        functions[path] += 1
    summary = dict(files=len(files), functions=len(calls), calls=sum(calls.values()),
                   per_file={p: dict(functions=functions[p], calls=files[p]) for p in files})
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for path in sorted(files):
        print(f"{path:45} {functions[path]:4} functions {files[path]:6} calls")
    print(f"{summary['files']} files, {summary['functions']} functions, "
          f"{summary['calls']} calls")


if __name__ == "__main__":
    main()
