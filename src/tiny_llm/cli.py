"""``tiny-llm chat``, ``generate``, ``serve`` and ``course``: the engine and the course from
a terminal. ``serve`` runs an OpenAI-compatible HTTP server (``serving/``); ``launch``
starts the ranks of a tensor-parallel run (``tensor_parallel.launch``).

Both ``chat`` and ``generate`` run the serving engine (``LLMEngine``); every engine option
is a flag (``--kv-cache dense``, ``--attention reference``, ``--num-pages 64``, ...), so
each chapter's configuration can be tried by hand, and ``--learner`` runs the engine on
the learner's own modules (``tiny-llm course``: start a day, see what passes).
``generate`` prints only the generated text on stdout (progress and load messages go to
stderr), so it composes with pipes. ``chat``
keeps the conversation, streams each reply, and treats Ctrl-C as "stop this reply" (the
request is aborted), not "quit"; a line it cannot use (invalid UTF-8, a conversation too
long) is reported and the conversation goes on.
"""

from __future__ import annotations

import argparse
import ast
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from typing import Any

from tiny_llm.sampling.params import SamplingParams


def token_tree_arg(text: str) -> Any:
    """``--speculative-token-tree``'s value: a Python literal (the engine checks the tree)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of paths of child ranks, e.g. '[(0,), (1,), (0, 0)]'"
        ) from None


# Engine options as flags: (flag, option, type, help).
ENGINE_FLAGS = [
    ("--max-num-seqs", "max_num_seqs", int, "requests that may run at once"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "the token budget of a step"),
    ("--max-model-len", "max_model_len", int, "prompt + output tokens per request"),
    ("--long-prefill-token-threshold", "long_prefill_token_threshold", int,
     "most prefill tokens one request gets in a step"),
    ("--scheduler", "scheduler", str, "continuous (Day 1) or static"),
    ("--kv-cache", "kv_cache", str, "dense (Days 1-2) or paged (Day 3)"),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--num-pages", "num_pages", int, "KV pool size in pages"),
    ("--kv-memory-bytes", "kv_memory_bytes", int, "KV pool size in bytes"),
    ("--kv-memory-fraction", "kv_memory_fraction", float, "KV pool as a share of free memory"),
    ("--attention", "attention", str,
     "dense, gather (Day 3), page_walk or vector (Day 4), tiled_walk or flash (Day 5)"),
    ("--speculative", "speculative", str, "off, ngram (prompt lookup) or draft (--draft-model)"),
    ("--num-speculative-tokens", "num_speculative_tokens", int, "tokens drafted per step"),
    ("--speculative-token-tree", "speculative_token_tree", token_tree_arg,
     "a tree of drafts: paths of child ranks, e.g. '[(0,), (1,), (0, 0)]'"),
    ("--speculative-max-batch", "speculative_max_batch", int, "no drafts above this batch"),
    ("--draft-model", "draft_model", str, "the draft: an HF folder, hub id or .gguf file"),
    ("--tensor-parallel-size", "tensor_parallel_size", int,
     "ranks the model is split over (start them with tiny-llm launch -n N --)"),
    ("--tensor-parallel-timeout", "tensor_parallel_timeout", float,
     "seconds a step may take, sent to the workers, before rank 0 gives up"),
    ("--logprobs-mode", "logprobs_mode", str, "what logprobs report: raw_logprobs (the "
     "model's, the default) or processed_logprobs (the distribution each token was drawn from)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiny-llm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("chat", "multi-turn chat"), ("generate", "complete one prompt")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--model", default=None, help="HF folder, hub id or .gguf file")
        p.add_argument("--temperature", type=float, default=0.7 if name == "chat" else 0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=-1)
        p.add_argument("--min-p", type=float, default=0.0)
        p.add_argument("--max-tokens", type=int, default=512 if name == "chat" else 128)
        p.add_argument("--seed", type=int, default=None)
        add_engine_options(p)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--model", default=None, help="HF folder, hub id or .gguf file")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: --model, or the default's)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-waiting", type=int, default=None,
                       help="answer 503 while this many requests wait (default: no limit)")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="answer 413 to larger request bodies (default 4 MiB)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 (default: the "
                            "TINY_LLM_API_KEY environment variable, else no key)")
    serve.add_argument("--api-key-for-all", action="store_true",
                       help="require the key on /health and /metrics too")
    serve.add_argument("--shutdown-timeout", type=float, default=None,
                       help="seconds requests in flight get after SIGTERM/SIGINT before they "
                            "end with an error (default 10; a second signal ends them at once)")
    serve.add_argument("--header-timeout", type=float, default=None,
                       help="seconds a request's headers may take to arrive before its "
                            "connection is closed (default 10)")
    serve.add_argument("--body-timeout", type=float, default=None,
                       help="seconds a request's body may take to arrive before a 408 "
                            "(default 60)")
    add_engine_options(serve)
    gen = sub.choices["generate"]
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as-is")
    # Everything after `launch` is mlx.launch's: no option of this parser may take it.
    launch = sub.add_parser("launch", add_help=False, prefix_chars="\0",
                            help="mlx.launch --backend ring, exiting non-zero if any rank fails "
                                 "(tiny-llm launch --help: its options)")
    launch.add_argument("mlx_launch_args", nargs=argparse.REMAINDER)
    course = sub.add_parser("course", help="the course: start a day, run its tests, status")
    steps = course.add_subparsers(dest="action", required=True)
    steps.add_parser("start", help="write a day's stubs into workspace/").add_argument(
        "day", type=int)
    steps.add_parser("reset", help="a task's stub back in your workspace (your file is saved "
                     "first)").add_argument("task", help="a task, such as 3.2")
    steps.add_parser("tasks", help="list the tasks of the course")
    steps.add_parser("status", help="pass / fail / not started, per task")
    test = steps.add_parser("test", help="run a day's or a task's tests on your workspace",
                            epilog="Arguments after the day or task go to pytest, e.g. "
                                   "`tiny-llm course test 3.2 -k fragmentation -x`.")
    test.add_argument("which", help="a day (3) or a task (3.2)")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER,
                      help="passed to pytest as they are")
    return parser


def add_engine_options(p: argparse.ArgumentParser) -> None:
    engine = p.add_argument_group("engine options (default: the final engine)")
    for flag, dest, kind, help_engine in ENGINE_FLAGS:
        engine.add_argument(flag, dest=dest, type=kind, default=None, help=help_engine)
    engine.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill",
                        action="store_false", default=None, help="prefill prompts whole")
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", default=None, help="never share pages")
    engine.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                        default=None, help="on a CPU, run the model on MLX's ops alone")
    engine.add_argument("--no-fused-layers", dest="fused_layers", action="store_false",
                        default=None, help="on a CPU, run decode steps' layers op by op (the same "
                        "tokens, slower) instead of one fused op for each run of dense layers")
    engine.add_argument("--int8-activations", dest="int8_activations", action="store_true",
                        default=None, help="with --quantized: decode rows of quantized layers "
                        "in int8 (faster from a few requests; logits move by the rounding)")
    engine.add_argument("--stats", action="store_true", help="print engine stats at the end")
    p.add_argument("--dtype", choices=("auto", "float16", "bfloat16", "float32"), default="auto",
                   help="the model's dtype: auto is float32 on a CPU and the checkpoint's own "
                        "dtype on a GPU (bfloat16 for Qwen3; float32 ones in bfloat16)")
    p.add_argument("--quantized", action="store_true",
                   help="keep a quantized checkpoint's weights as stored (the default GGUF: 4-bit "
                        "layers, an 8-bit embedding); on a CPU the default dequantizes to float32")
    p.add_argument("--learner", action="store_true",
                   help="run on your workspace's modules (the course), else the reference")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (the rest keep their defaults)."""
    from tiny_llm.engine import EngineConfig

    names = {f.name for f in fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def load_engine(args: argparse.Namespace):
    from tiny_llm.engine import EngineConfig, LLMEngine

    options = engine_options(args)
    EngineConfig.from_options(options)  # reject bad options before the (slow) model load
    start = time.perf_counter()
    print("loading model ...", file=sys.stderr, flush=True)
    engine = LLMEngine.from_pretrained(args.model, dtype=args.dtype,
                                       dequantize=False if args.quantized else None, **options)
    print(f"loaded in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return engine


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)


def print_stats(engine, args: argparse.Namespace) -> None:
    if args.stats:
        for key, value in engine.stats().items():
            print(f"{key}: {value}", file=sys.stderr)


def run_serve(args: argparse.Namespace) -> int:
    from tiny_llm.serving import app, handlers

    options = dict(
        max_body_bytes=(handlers.DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None
                        else args.max_body_bytes),
        api_key=args.api_key if args.api_key is not None else os.environ.get(handlers.API_KEY_ENV),
        key_for_all=args.api_key_for_all,
        shutdown_timeout=(handlers.DEFAULT_SHUTDOWN_TIMEOUT if args.shutdown_timeout is None
                          else args.shutdown_timeout),
        header_timeout=(handlers.DEFAULT_HEADER_TIMEOUT if args.header_timeout is None
                        else args.header_timeout),
        body_timeout=(handlers.DEFAULT_BODY_TIMEOUT if args.body_timeout is None
                      else args.body_timeout))
    handlers.check_options(args.max_waiting, **options)  # before the (slow) model load
    engine = load_engine(args)
    app.serve(engine, served_model_name(args), host=args.host, port=args.port,
                 max_waiting=args.max_waiting, **options)
    print_stats(engine, args)
    return 0


def served_model_name(args: argparse.Namespace) -> str:
    """The model id clients see: --served-model-name, a hub id as given, or a local
    model's file or folder name (never its path)."""
    from pathlib import Path

    from tiny_llm.models.loader import DEFAULT_GGUF

    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_GGUF.removesuffix(".gguf")
    path = Path(args.model).expanduser()
    if path.exists() or args.model.startswith((".", "/", "~")):
        path = Path(os.path.abspath(path))  # not resolve(): a symlink keeps its own name
        return (path.stem if path.suffix == ".gguf" else path.name) or "model"
    return args.model


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_from(args)  # validate before the (slow) model load
    engine = load_engine(args)
    prompt = args.prompt if args.no_chat_template else [{"role": "user", "content": args.prompt}]
    for out in engine.stream(prompt, params):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print_stats(engine, args)
    return 0


# ANCHOR: chat
def run_chat(args: argparse.Namespace) -> int:
    params = sampling_from(args)
    engine = load_engine(args)
    # Undecodable input arrives as lone surrogates, which the engine refuses with the
    # position: the line is reported, not the end of the chat.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    history: list[dict[str, str]] = []
    print("chat with the model; /reset clears the conversation, /exit quits, "
          "Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            print_stats(engine, args)
            return 0
        if line in ("/exit", "/quit"):
            print_stats(engine, args)
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
        except ValueError as e:  # invalid text, or the conversation outgrew max_model_len
            history.pop()
            print(f"tiny-llm: {e} (the conversation is kept; /reset clears it)",
                  file=sys.stderr)
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


def run_course(args: argparse.Namespace) -> int:
    from tiny_llm.course import workspace as course

    if args.action == "start":
        for line in course.start(args.day):
            print(line)
        chapter = course.CHAPTERS[args.day]
        page = chapter[0].removesuffix(".md") + ".html"
        print(f"\nread '{chapter[1]}' in the book (`make book`, then open book/book/{page}); "
              f"check a task with\n  tiny-llm course test {args.day}.1")
        return 0
    if args.action == "reset":
        for line in course.reset(args.task):
            print(line)
        return 0
    if args.action == "tasks":
        for task in course.tasks().values():
            files = ", ".join(sorted({str(r.path) for r in task.regions}))
            print(f"{task.id:>4}  {task.title}  [{files}]  — '{task.section}'")
        return 0
    if args.action == "test":
        try:
            day, task_id = course.resolve(args.which)
        except ValueError as e:
            print(f"tiny-llm course test: {e}", file=sys.stderr)
            return 2
        if day not in course.started_days():
            print(f"Day {day} is not started: run `tiny-llm course start {day}` first (until "
                  "then its tests would run the reference, not your code)", file=sys.stderr)
            return 2
        selected = [] if task_id is None else ["--task", task_id]
        files = sorted({str(f) for t in course.tasks().values() if t.day == day and (
            task_id is None or t.id == task_id) for f in course.test_files(t)})
        cmd = [sys.executable, "-m", "pytest", *files, "--learner", *selected,
               *args.pytest_args]
        return subprocess.call(cmd, cwd=course.TESTS.parent)
    for path in course.reference_edits():
        print(f"note: the reference file {path} has changed since the last commit; your "
              "work belongs in workspace/ (git diff shows what changed)", file=sys.stderr)
    results = course.status()
    day = None
    for task, result in results:
        if task.day != day:
            day = task.day
            print(f"\n{course.CHAPTERS[day][1]}")
        print(f"  {task.id:>4}  {result:<12} {task.title}")
    todo = next(((t, r) for t, r in results if r == "fail"), None) or next(
        ((t, r) for t, r in results if r == "not started"), None)
    if todo is None:
        print("\nevery task passes")
    else:
        task, result = todo
        verb = "start it with `tiny-llm course start " + str(task.day) + "`; " if (
            result == "not started") else ""
        print(f"\nnext: Task {task.id} — {verb}read '{task.heading}' in "
              f"book/src/{task.chapter}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "course":
            return run_course(args)
        if args.command == "launch":
            from tiny_llm.distributed.workers import launch

            return launch(args.mlx_launch_args)
        if args.learner:
            os.environ.setdefault("TINY_LLM_LEARNER", "1")  # before any day is imported
            from tiny_llm.course import learner

            print(f"tiny-llm: {learner.describe()}", file=sys.stderr)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        return run_chat(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, ImportError) as e:
        print(f"tiny-llm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`tiny-llm generate ... | head`): stop quietly, and keep
        # Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141 if hasattr(signal, "SIGPIPE") else 1


if __name__ == "__main__":
    sys.exit(main())
