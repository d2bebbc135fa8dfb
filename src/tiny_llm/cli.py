"""``tiny-llm chat`` and ``tiny-llm generate``: the engine from a terminal.

Both commands run the serving engine (``LLMEngine``) with its default configuration.
``generate`` prints only the generated text on stdout (progress and load messages go to
stderr), so it composes with pipes. ``chat`` keeps the conversation, streams each reply,
and treats Ctrl-C as "stop this reply" (the request is aborted), not "quit".
"""

from __future__ import annotations

import argparse
import sys
import time

from tiny_llm.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiny-llm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("chat", "multi-turn chat"), ("generate", "complete one prompt")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--model", default=None, help="HF folder, hub id or .gguf file")
        p.add_argument("--temperature", type=float, default=0.7 if name == "chat" else 0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--max-tokens", type=int, default=512 if name == "chat" else 128)
        p.add_argument("--seed", type=int, default=None)
    gen = sub.choices["generate"]
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as-is")
    return parser


def load_engine(model: str | None):
    from tiny_llm.engine import LLMEngine

    start = time.perf_counter()
    print("loading model ...", file=sys.stderr, flush=True)
    engine = LLMEngine.from_pretrained(model)
    print(f"loaded in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return engine


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_from(args)  # validate before the (slow) model load
    engine = load_engine(args.model)
    prompt = args.prompt if args.no_chat_template else [{"role": "user", "content": args.prompt}]
    for out in engine.stream(prompt, params):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


# ANCHOR: chat
def run_chat(args: argparse.Namespace) -> int:
    params = sampling_from(args)
    engine = load_engine(args.model)
    history: list[dict[str, str]] = []
    print("chat with the model; /reset clears the conversation, /exit quits, "
          "Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = stream_reply(engine, history, params)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            history.pop()
            print(f"tiny-llm: {e} (try /reset)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})


def stream_reply(engine, history: list[dict[str, str]], params: SamplingParams) -> str:
    parts: list[str] = []
    stream = engine.stream(list(history), params)  # bad input raises here, before "bot>"
    sys.stdout.write("bot> ")
    try:
        for out in stream:
            parts.append(out.text_delta)
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()  # aborts the request; the engine stays usable
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    return "".join(parts)
# ANCHOR_END: chat


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        return run_chat(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"tiny-llm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
